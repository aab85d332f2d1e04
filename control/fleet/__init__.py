"""Standing a deployment up and running it: the supervisor, the embedded Valkey and its
credentials, the operator's API, the region client.
"""
