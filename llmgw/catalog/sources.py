"""Where a model's (or adapter's) weights come from: parsing a catalog ``source``.

A source is one of:

- a local path (``/models/x.gguf``, ``file:///models/x``): used in place, never copied;
- an http(s) URL of one file (``https://host/x.gguf``, optionally ``#sha256=HEX`` to check it);
- a Hugging Face repository: ``hf://org/repo`` or ``hf://org/repo@revision``, or a repository
  page URL on the configured endpoint (``https://huggingface.co/org/repo``,
  ``.../org/repo/tree/REV``), read as the repository id;
- a training job's result kept by the control plane: ``llmgw-job://JOB`` (an adapter trained by
  ``llmgw ctl jobs train``), fetched over the node's session.

The catalog parses a source when a model is added (so a malformed one never enters it);
the agent parses it again to fetch the weights (:mod:`llmgw.node.fetch`). Pure: no I/O.
"""

from __future__ import annotations

import re
from urllib.parse import unquote, urlsplit

import attrs

from llmgw.config.defaults import DEFAULT_HF_ENDPOINT

__all__ = ["JOB_SCHEME", "SourceError", "WeightsSource", "is_remote", "job_source", "parse_source"]

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")


class SourceError(ValueError):
    """A ``source`` that names nothing llmgw can fetch; ``str()`` says what form is expected."""


@attrs.frozen
class WeightsSource:
    """A parsed ``source``. ``kind`` is "local", "url", "hf" or "job"."""

    kind: str
    location: str  # the path (local), the URL without fragment (url), "org/repo" (hf) or the job id (job)
    revision: str = "main"  # hf only
    sha256: str = ""  # url only: from a "#sha256=HEX" fragment


#: The scheme of a training job's result as a source (``llmgw-job://job-1a2b3c4d``).
JOB_SCHEME = "llmgw-job://"
_JOB_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


def is_remote(source: str) -> bool:
    """Returns True when ``source`` must be downloaded (an http(s) URL, an hf:// repository, or a
    training job's result on the control plane)."""
    return source.startswith(("http://", "https://", "hf://", JOB_SCHEME))


def job_source(job_id: str) -> str:
    """Returns the source naming training job ``job_id``'s result."""
    return JOB_SCHEME + job_id


def parse_source(source: str, hf_endpoint: str = DEFAULT_HF_ENDPOINT) -> WeightsSource:
    """Returns what ``source`` names (see the module docstring).

    A URL on ``hf_endpoint``'s host (or huggingface.co) whose path is ``/org/repo`` or
    ``/org/repo/tree/REV`` is a repository page; ``/org/repo/resolve/REV/file`` and any
    other URL is one file. Raises :class:`SourceError` for an empty source, a malformed
    repository id or a malformed ``#sha256=`` fragment.
    """
    source = source.strip()
    if not source:
        raise SourceError("the model has no weights source; set the model's source to a path, URL or hf://org/repo")
    if source.startswith(JOB_SCHEME):
        job_id = source[len(JOB_SCHEME):]
        if not _JOB_ID.match(job_id):
            raise SourceError(f"source {source!r}: write {JOB_SCHEME}JOB with a job id from `llmgw ctl jobs list`")
        return WeightsSource("job", job_id)
    if source.startswith("hf://"):
        repo, _, rev = source[len("hf://") :].partition("@")
        return _hf_source(source, repo.strip("/"), rev or "main")
    if source.startswith(("http://", "https://")):
        parts = urlsplit(source)
        hub_hosts = {urlsplit(hf_endpoint).netloc, "huggingface.co"}
        segments = [unquote(s) for s in parts.path.split("/") if s]
        if parts.netloc in hub_hosts and len(segments) in (2, 4) and not parts.query:
            if len(segments) == 2:
                return _hf_source(source, "/".join(segments), "main")
            if segments[2] == "tree":
                return _hf_source(source, "/".join(segments[:2]), segments[3])
        sha = ""
        fragment = parts.fragment
        if fragment.startswith("sha256="):
            sha = fragment[len("sha256=") :]
            if not _HEX64.match(sha):
                raise SourceError(f"weights source {source!r}: '#sha256=' must be followed by 64 hex digits")
        url = parts._replace(fragment="").geturl()
        return WeightsSource("url", url, sha256=sha.lower())
    if source.startswith("file://"):
        return WeightsSource("local", unquote(urlsplit(source).path))
    return WeightsSource("local", source)


def _hf_source(source: str, repo: str, revision: str) -> WeightsSource:
    """Returns the repository source ``repo``@``revision``; raises SourceError if ``repo`` is no repository id."""
    if not _REPO_ID.match(repo) or ".." in repo:
        raise SourceError(
            f"weights source {source!r}: {repo!r} is not a Hugging Face repository id; write hf://org/repo[@revision]"
        )
    return WeightsSource("hf", repo, revision=revision)
