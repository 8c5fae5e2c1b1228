"""The gateway's HTTP stack below Quart: the hot path of a forwarded request, layer by layer.

Quart-Trio serves the gateway's own endpoints (model listing, health, metrics); a
forwarded POST bypasses it. From the client's socket to the engine's and back:

* :mod:`.serve`: binds the listening socket and runs Hypercorn's trio server on the app
  (``serve_gateway``); applies :mod:`.hypercorn_patch` first.
* :mod:`.hypercorn_patch`: the one call that patches Hypercorn (``apply``: a close-race
  fix, a lean keep-alive timer, one write per response, an on-close hook, the lane
  below), with a guard against a Hypercorn release it was not checked against.
* :mod:`.h1lane`: the HTTP/1.1 connection protocol: simple, complete requests skip h11
  and Hypercorn's per-request stream.
* :mod:`.forward`: the ASGI layer in front of Quart: forwarded POSTs go straight to
  ``Gateway.forward``; every request gets its id (:mod:`.request_id`) here.
* :mod:`.cleanup`: what a forwarded request holds (leases, upstream responses), released
  however it ends, and the ASGI layer shielding a response's last send.
* :mod:`.upstream`: the client towards the engines (deadlines per phase, errors
  described, failures counted) over :mod:`.upstream_pool`, a lean keep-alive HTTP/1.1
  connection pool per replica.
* :mod:`.eagerio`: socket reads and writes that yield only when they must wait (used by
  the lane, the patched server and the pool).
* :mod:`.extensions`: the ASGI scope extension keys these layers share.

Nothing here imports the gateway app (:mod:`llmgw.router.app`); the app imports these.
"""
