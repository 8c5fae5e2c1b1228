"""Cap'n Proto RPC on trio: the pycapnp backend, TLS, connections, wire conversions."""
