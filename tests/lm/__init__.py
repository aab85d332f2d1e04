"""The torch engine and the local code models."""
