"""The gateway's multi-process mode (``gateway.workers`` > 1): the pool of worker processes
(:mod:`.pool`), the worker process itself (:mod:`.worker`), and what crosses between them
(:mod:`.channel`, :mod:`.protocol`). Nothing is imported here, so that starting a worker
loads only what it uses."""
