"""The Celery app and the Celery and kombu internals the replicas lean on."""
