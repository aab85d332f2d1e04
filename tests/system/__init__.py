"""Whole deployments: real Valkey, Celery worker processes and the HTTP server."""
