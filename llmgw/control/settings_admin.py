"""The Admin methods for cluster settings (``llmgw ctl config``), a mixin.

:func:`llmgw.control.admin.make_admin` calls :meth:`SettingsAdminMixin.bind_settings`
with the store, the actor, and what to do after a setting the gateway applies
(``serving.stopped``, ``routing``) or one the agents apply (``agents.*``) changed. Every change is
checked first (:mod:`llmgw.control.settings`: the key path and the reason on refusal), stored
as a new version and audited.
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from llmgw.control.settings import GATEWAY_SETTINGS, SettingError, edit, parse_key
from llmgw.control.store import Store
from llmgw.control.store.base import SettingVersion


def setting_dict(s: SettingVersion) -> dict[str, Any]:
    """Returns ``s`` as a capnp ``Setting``."""
    return {"key": s.key, "valueJson": json.dumps(s.value), "version": s.version, "updatedAt": s.updated_at,
            "actor": s.actor}


class SettingsAdminMixin:
    """getSettings, setSetting, settingHistory (see schema/llmgw.capnp)."""

    _settings_store: Store
    _settings_actor: str
    _gateway_applied: Callable[[str], Awaitable[None]]
    _agents_changed: Callable[[], None]

    def bind_settings(
        self, store: Store, actor: str, gateway_applied: Callable[[str], Awaitable[None]],
        agents_changed: Callable[[], None],
    ) -> None:
        """Act on ``store`` for ``actor``; ``gateway_applied(stored key)`` is awaited after one
        of :data:`~llmgw.control.settings.GATEWAY_SETTINGS` changed (every gateway applies it;
        for ``serving.stopped`` the reconciler frees or places), ``agents_changed`` called
        after an ``agents.*`` setting changed (pushed to the nodes)."""
        self._settings_store = store
        self._settings_actor = actor
        self._gateway_applied = gateway_applied
        self._agents_changed = agents_changed

    async def getSettings(self, key: str, _context: Any, **_: Any) -> None:
        store = self._settings_store
        if not key:
            rows = [s for s in await store.list_settings() if s.value is not None]
        else:
            current = await store.get_setting(_parsed(str(key)).stored)
            rows = [current] if current is not None and current.value is not None else []
        _context.results.settings = [setting_dict(s) for s in rows]

    async def setSetting(self, key: str, valueJson: str, unset: bool, _context: Any, **_: Any) -> None:
        parsed = _parsed(str(key))
        value: Any = None
        if not unset:
            try:
                value = json.loads(str(valueJson))
            except ValueError as exc:
                raise ValueError(f"{parsed}: the value is not JSON: {exc}") from None
        store = self._settings_store
        current = await store.get_setting(parsed.stored)
        try:
            new = edit(current.value if current is not None else None, parsed, value, unset=bool(unset))
        except SettingError as exc:
            raise ValueError(str(exc)) from None
        version = await store.set_setting(parsed.stored, new, self._settings_actor)
        await store.audit(self._settings_actor, "setting.unset" if unset else "setting.set", str(parsed),
                          {"stored_key": parsed.stored, "version": version, "value": new})
        if parsed.stored in GATEWAY_SETTINGS:
            await self._gateway_applied(parsed.stored)
        else:
            self._agents_changed()
        saved = await store.get_setting(parsed.stored)
        assert saved is not None
        _context.results.setting = setting_dict(saved)

    async def settingHistory(self, key: str, _context: Any, **_: Any) -> None:
        versions = await self._settings_store.setting_history(_parsed(str(key)).stored)
        _context.results.versions = [setting_dict(s) for s in versions]


def _parsed(key: str) -> Any:
    try:
        return parse_key(key)
    except SettingError as exc:
        raise ValueError(str(exc)) from None
