"""What a proxy is pointed at, validated before any socket is opened.

A typo in an upstream URL should fail at start-up with the flag named, not as
a 502 on the first client request, so the URLs are checked here (http or https,
a host, nothing after the path) and normalised (no trailing ``/``) so that the
request paths can be appended as they are.
"""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kvmux.errors import KvmuxError
from kvmux.problems import problems_of


def _http_url(url: str) -> str:
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https"):
        raise ValueError("must be an http:// or https:// URL, e.g. http://127.0.0.1:8100")
    if not parts.hostname:
        raise ValueError("has no host")
    try:
        parts.port  # noqa: B018 - parsing it is the check
    except ValueError as exc:
        raise ValueError(f"has a bad port ({exc})") from None
    if parts.query or parts.fragment:
        raise ValueError("must not have a query or fragment")
    return url.strip().rstrip("/")


UpstreamUrl = Annotated[str, AfterValidator(_http_url)]


class ProxyConfig(BaseModel):
    """Upstreams and limits of one ``kvmux proxy``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    colocated: bool = Field(
        False,
        description="no prefill stage: each request goes whole to the least loaded --decode server "
        "(colocated serving, e.g. to compare it with P/D behind the same front end)",
    )
    prefill: list[UpstreamUrl] = Field(
        default_factory=list,
        validate_default=True,
        description="base URLs of the prefill vLLM servers (least loaded first); "
        "none when colocated",
    )
    decode: list[UpstreamUrl] = Field(
        min_length=1,
        description="base URLs of the decode vLLM servers (least loaded first); when colocated, "
        "the servers that answer whole requests",
    )
    host: str = Field("127.0.0.1", description="address to listen on (loopback by default)")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on; 0 picks a free one")
    timeout_s: float = Field(
        600.0, gt=0, description="deadline for one client request, prefill and decode together"
    )
    unreachable_after_s: float = Field(
        10.0,
        gt=0,
        description="how long an upstream's host may leave a connect, or a connection's "
        "keepalive probes, unanswered before it counts as unreachable (taken out of rotation, "
        "the request tried on another where it was never seen): a cut link or a host gone, "
        "told apart from a slow answer by the kernel",
    )
    upstream_keepalive_s: float = Field(
        4.0,
        gt=0,
        description="longest an idle connection to an upstream is kept for the next request; "
        "below the upstreams' own keep-alive (vLLM closes an idle connection after "
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s by default), or a request may go out on a "
        "connection the server is closing and fail as 'Server disconnected'",
    )
    health_timeout_s: float = Field(
        5.0, gt=0, description="how long GET /health waits for each upstream's /health"
    )
    probe_interval_s: float = Field(
        2.0, gt=0, description="how often an upstream out of rotation has its /health probed"
    )
    prefix_routes: int = Field(
        10_000,
        ge=0,
        description="prompt-prefix chunks remembered for prefix-aware routing; 0 turns it off",
    )
    max_body_bytes: int = Field(
        64 * 2**20, gt=0, description="largest client request body (long prompts are big)"
    )

    @field_validator("prefill")
    @classmethod
    def _prefill_matches_mode(cls, urls: list[str], info: ValidationInfo) -> list[str]:
        """P/D needs a prefill server; colocated serving has no prefill stage to send to."""
        colocated = info.data.get("colocated", False)
        if colocated and urls:
            raise ValueError("colocated serving has no prefill stage: leave --prefill out")
        if not colocated and not urls:
            raise ValueError("at least one prefill server is needed (or --colocated)")
        return urls

    @model_validator(mode="after")
    def _distinct_urls(self) -> ProxyConfig:
        for role, urls in (("prefill", self.prefill), ("decode", self.decode)):
            twice = sorted({url for url in urls if urls.count(url) > 1})
            if twice:
                raise ValueError(f"{role} URLs listed more than once: {twice}")
        return self


class ProxyConfigError(KvmuxError, ValueError):
    """Proxy settings that do not validate; the message names the command-line flag."""


def config_from_flags(**flags: object) -> ProxyConfig:
    """A :class:`ProxyConfig` from command-line values, errors phrased as ``--flag``."""
    try:
        return ProxyConfig.model_validate(flags)
    except ValidationError as exc:
        lines = [
            f"  {_flag(path)} {value!r}: {message}" for path, message, value in problems_of(exc)
        ]
        raise ProxyConfigError("invalid kvmux proxy settings:\n" + "\n".join(lines)) from None


def _flag(path: str) -> str:
    """The command-line flag a config path comes from (``prefill.0`` -> ``--prefill``)."""
    field = path.partition(".")[0]
    return "--" + field.replace("_", "-") if field else "<flags>"
