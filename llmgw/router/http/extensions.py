"""Keys the gateway's HTTP layers put in an ASGI request's ``scope["extensions"]``.

They are how the layers talk without importing each other: the HTTP/1.1 lane
(:mod:`.h1lane`) and the patched Hypercorn stream (:mod:`.hypercorn_patch`) set or call
them, and the app-level forward (:mod:`.forward`) and the gateway app read them. Each
value is a plain string; what is stored under it is described beside it.
"""

from __future__ import annotations

#: A callable (no arguments, synchronous, must not raise) the app may store; the server
#: calls it when the request's stream closes: the client went away, or the exchange
#: ended. It saves the app a task per request that would otherwise wait for
#: ``http.disconnect`` (which is still sent).
ON_CLOSE_KEY = "llmgw.on_close"

#: Set by the lane on a request it serves: the whole body (bytes), which ``receive()``
#: would also give as its first message. An app may take it from here instead (the
#: gateway's forward does: no receive call and no body timer).
WHOLE_BODY_KEY = "llmgw.whole_body"

#: Set (value True) by the lane on a request it serves: the lane finishes its exchange
#: (recycles or closes the connection) even if the app is cancelled during its last
#: send, so the app need not shield that send, as it must for Hypercorn's own HTTP/1.1
#: protocol (see :func:`~llmgw.router.http.cleanup.shield_last_send`); and it cancels the
#: app when the client goes away mid-exchange, so the app needs no scope of its own for
#: :data:`ON_CLOSE_KEY` to cancel (it is still called).
FAST_LANE_KEY = "llmgw.fast_lane"

#: The request's id (str), set by :class:`~llmgw.router.http.forward.FastForward` on every
#: HTTP request before anything else reads it (see :mod:`.request_id`).
REQUEST_ID_KEY = "llmgw.request_id"

#: Set by the lane on a request it serves: a
#: :class:`~llmgw.router.http.forward.BodySink` that sends the pieces of a chunked
#: response once ``http.response.start`` has gone (before that, and for a response with a
#: content-length, it hands each piece to the lane's ASGI ``send``). Middlewares that
#: watch the body wrap it (:class:`~llmgw.router.instrument.Instrumentation`). It saves a
#: relayed stream the message dict and the layers of ``send`` per event (and a write: its
#: head goes with its first piece, ``start``), and a whole response its two messages
#: (``respond``). A middleware that watches or changes responses
#: through ``send`` must wrap the sink too (a :class:`~llmgw.router.http.forward.SinkWrapper`,
#: as the gateway workers' ``WorkerFront`` does), or whole responses pass it by.
BODY_SINK_KEY = "llmgw.body_sink"
