"""The gateway's HTTP server: gunicorn, the header parser, the connection table and the
redis-py adapter it needs.
"""
