"""The worker side: Celery app, batching collector, replica loop and engines."""
