"""Replica policy on plain data: the collector, the pull gate, the scheduler and step costs
(no Celery, no torch).
"""
