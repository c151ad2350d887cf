"""kvservice-client: the contract kvservice shares with its users.

* :mod:`kvservice_client.events`: KV event structs (msgspec, vLLM's msgpack layout).
* :mod:`kvservice_client.hashing`: the block-hash rule, so a watcher hashes a prompt as the server.
"""
