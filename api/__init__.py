"""The HTTP gateway: the Flask app, its blueprints and the gateway's side of the request path;
api/server holds the HTTP server it runs under."""
