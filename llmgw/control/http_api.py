"""The HTTP admin API, ``/api/v1/*`` on every control plane's gateway port (docs/admin-api.md).

Each call carries an admin token (``Authorization: Bearer llmgwadmin_...``,
llmgw/control/admin_tokens.py) and is made through the same ``Admin`` capability ``llmgw
ctl`` gets: on the leader its own, on a standby the leader's, passed over the standby's
``ControlPeer`` session (mutual TLS, control-plane certificates), so every control plane
answers the same and the leader checks and audits every change (actor ``token NAME``, ``via``
the standby). The answers are what ``llmgw ctl --json`` prints for the same command.

Routes (``PATH`` below ``/api/v1/``):

=======  ==========================  ==========================================
GET      ``status``                  ``ctl status``
GET      ``nodes``                   ``ctl nodes``
GET      ``replicas``                ``ctl replicas`` (``replicas``, ``unplaceable``)
GET      ``models``                  ``ctl models list``
GET      ``settings[/KEY]``          ``ctl config get [KEY]``
GET      ``settings/KEY/history``    ``ctl config history KEY``
PUT      ``settings/KEY``            ``ctl config set KEY`` (the body: the value, JSON)
DELETE   ``settings/KEY``            ``ctl config unset KEY``
POST     ``stop``, ``start``         ``ctl stop``, ``ctl start``
=======  ==========================  ==========================================

Errors are ``{"error": {"message", "code"}}``: 401 (token), 404 (no such route), 405,
400 (the cluster refused the call: its reason), 503 (no leader to answer now).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Awaitable, Callable

from llmgw.client import ClientError, ClusterClient
from llmgw.jsonable import to_jsonable
from llmgw.control.admin_tokens import AdminAuthError, authenticate
from llmgw.control.store import Store
from llmgw.router.interface import ApiRequest, ApiResponse, api_error
from llmgw.rpc import schema
from llmgw.spec import model_to_dict

log = logging.getLogger(__name__)

#: ``(client, key, body) -> answer`` for one route.
Action = Callable[[ClusterClient, str, bytes], Awaitable[Any]]


async def _status(c: ClusterClient, _key: str, _body: bytes) -> Any:
    return await c.status()


async def _nodes(c: ClusterClient, _key: str, _body: bytes) -> Any:
    return await c.nodes()


async def _replicas(c: ClusterClient, _key: str, _body: bytes) -> Any:
    replicas, unplaceable = await c.replicas()
    return {"replicas": replicas, "unplaceable": unplaceable}


async def _models(c: ClusterClient, _key: str, _body: bytes) -> Any:
    return [model_to_dict(m) for m in await c.models()]


async def _settings(c: ClusterClient, key: str, _body: bytes) -> Any:
    return await c.settings(key)


async def _history(c: ClusterClient, key: str, _body: bytes) -> Any:
    return await c.setting_history(key)


async def _set(c: ClusterClient, key: str, body: bytes) -> Any:
    try:
        value = json.loads(body)
    except ValueError as exc:
        raise ClientError(f"{key}: the body is not JSON (send the value itself, e.g. \"round-robin\"): {exc}") from None
    return await c.set_setting(key, value)


async def _unset(c: ClusterClient, key: str, _body: bytes) -> Any:
    return await c.unset_setting(key)


async def _stop(c: ClusterClient, _key: str, _body: bytes) -> Any:
    return {"stopped": await c.set_serving_stopped(True)}


async def _start(c: ClusterClient, _key: str, _body: bytes) -> Any:
    return {"stopped": await c.set_serving_stopped(False)}


#: (method, first path part) -> action; ``settings`` routes take a key (and ``/history``).
ROUTES: dict[tuple[str, str], Action] = {
    ("GET", "status"): _status,
    ("GET", "nodes"): _nodes,
    ("GET", "replicas"): _replicas,
    ("GET", "models"): _models,
    ("GET", "settings"): _settings,
    ("PUT", "settings"): _set,
    ("DELETE", "settings"): _unset,
    ("POST", "stop"): _stop,
    ("POST", "start"): _start,
}


def route(method: str, path: str) -> tuple[Action, str] | ApiResponse:
    """Returns the action for ``method`` on ``path`` (below /api/v1/) with its setting key
    ("" for none), or the 404/405 answer."""
    head, _, rest = path.strip("/").partition("/")
    if head == "settings" and method == "GET" and rest.endswith("/history"):
        return _history, rest.removesuffix("/history")
    if not any(name == head for _, name in ROUTES):
        return api_error(404, f"no admin API route /api/v1/{path} (docs/admin-api.md lists them)", "not_found")
    action = ROUTES.get((method, head))
    if action is None:
        allowed = sorted(m for m, name in ROUTES if name == head)
        return api_error(405, f"/api/v1/{head} answers {', '.join(allowed)}, not {method}", "method_not_allowed")
    if head == "settings" and method != "GET" and not rest:
        return api_error(404, f"{method} /api/v1/settings needs a key: /api/v1/settings/KEY", "not_found")
    if head != "settings" and rest:
        return api_error(404, f"no admin API route /api/v1/{path}", "not_found")
    return action, rest


class HttpAdminApi:
    """Answers /api/v1/* calls (the gateway's :data:`~llmgw.router.admin_api.AdminApiHandler`).

    ``admin_for(actor, via)`` returns the ``Admin`` capability (or server object) for
    ``actor``: the leader's, through the standby's peer session on a standby; it raises
    when no leader can answer now.
    """

    def __init__(self, store: Store, admin_for: Callable[[str, str], Awaitable[Any]]) -> None:
        self.store = store
        self.admin_for = admin_for

    async def __call__(self, request: ApiRequest) -> ApiResponse:
        """Returns the answer to ``request``; never raises (an unexpected error is a 500 whose
        message names the log line with the traceback)."""
        try:
            return await self._answer(request)
        except Exception:  # noqa: BLE001 - the caller gets an answer, the log the traceback
            log.exception("admin API %s /api/v1/%s failed", request.method, request.path)
            return api_error(500, "internal error (see the control plane's log)", "internal_error")

    async def _answer(self, request: ApiRequest) -> ApiResponse:
        try:
            token = await authenticate(self.store, request.authorization)
        except AdminAuthError as exc:
            return api_error(401, str(exc), "invalid_admin_token")
        found = route(request.method, request.path)
        if isinstance(found, ApiResponse):
            return found
        action, key = found
        try:
            admin = await self.admin_for(f"token {token.name}", "")
        except Exception as exc:  # noqa: BLE001 - no leader reachable now: the reason, 503
            return api_error(503, f"no leader can answer now: {exc}", "no_leader")
        client = ClusterClient(_as_client(admin), "the leader")
        try:
            result = await action(client, key, request.body)
        except ClientError as exc:
            return api_error(400, str(exc), "refused")
        return ApiResponse(200, to_jsonable(result))


def _as_client(admin: Any) -> Any:
    """Returns ``admin`` as a capability to call: the leader's own server object wrapped,
    a standby's capability (from the leader) as it is."""
    admin_schema = schema.load().Admin
    return admin_schema._new_client(admin) if isinstance(admin, admin_schema.Server) else admin
