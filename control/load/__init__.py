"""Load against a gateway: the load generator, its HTTP client and the request bodies."""
