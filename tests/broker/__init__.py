"""Against a real Valkey, without Celery workers or a gateway."""
