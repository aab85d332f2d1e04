"""One model replica: its loop, its broker calls, its Celery glue and the engine factory."""
