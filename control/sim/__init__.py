"""The simulator of the fleet, running the live policy code on a virtual clock, and the
capacity answer built on it.
"""
