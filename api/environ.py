"""What the gateway's server puts in a request's WSGI environ beyond WSGI's own keys.

The app reads them where present and falls back to WSGI where not (another server,
Flask's test client)."""

from __future__ import annotations

# The request's whole body as bytes, read before the app runs (api/server/handler.py);
# `wsgi.input` holds the same bytes, unread, for whoever reads the stream.
BODY = "keybatch.body"
