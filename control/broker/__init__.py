"""The broker contract: key names, the Lua scripts, the records that cross processes, the
queue envelope, traffic and the replica registry.
"""
