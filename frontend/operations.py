"""`tandem serve`'s operations flags (vLLM's spellings): CORS, OpenTelemetry tracing and the
metric-name alias, checked together at start-up so a wrong one fails there, naming itself.

CORS is off unless ``--allowed-origins`` is given (a browser then gets Starlette's
CORSMiddleware answers); the other three CORS flags only shape it, so giving one of them alone
is refused rather than ignored.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass


@dataclass(frozen=True)
class CorsSettings:
    """Starlette CORSMiddleware's arguments."""

    allow_origins: list[str]
    allow_methods: list[str]
    allow_headers: list[str]
    allow_credentials: bool


def add_operations_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("operations")
    group.add_argument(
        "--allowed-origins", type=json_string_list, default=None, metavar="JSON",
        help='CORS: the origins browsers may call from, as a JSON list (["https://a.example"], '
        '["*"] for any); CORS is off unless given',
    )  # fmt: skip
    group.add_argument(
        "--allowed-methods", type=json_string_list, default=None, metavar="JSON",
        help='CORS: the methods allowed, as a JSON list (default with --allowed-origins: ["*"])',
    )  # fmt: skip
    group.add_argument(
        "--allowed-headers", type=json_string_list, default=None, metavar="JSON",
        help='CORS: the request headers allowed, as a JSON list (default with '
        '--allowed-origins: ["*"])',
    )  # fmt: skip
    group.add_argument(
        "--allow-credentials", action="store_true",
        help="CORS: allow cookies and Authorization on cross-origin requests",
    )  # fmt: skip
    group.add_argument(
        "--otlp-traces-endpoint", default=None, metavar="URL",
        help="export a trace of each request (API span; engine queue, prefill and decode "
        "spans) to this OTLP/HTTP collector, e.g. http://collector:4318/v1/traces; honours "
        "the client's W3C traceparent. Needs pip install 'tandem[tracing]' (default: off)",
    )  # fmt: skip
    group.add_argument(
        "--metrics-name-alias", choices=["vllm"], default=None,
        help="also expose /metrics families under vLLM's names (vllm:...) where the meaning "
        "is the same, for vLLM's Grafana dashboard (docs/deployment.md lists them)",
    )  # fmt: skip


def json_string_list(text: str) -> list[str]:
    """A JSON list of strings (argparse names the flag in its error)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f'a JSON list of strings is expected, like ["*"]: {text}')
    return value


def check_operations_args(args: argparse.Namespace) -> None:
    """ValueError for a CORS flag without --allowed-origins, or a tracing endpoint that cannot
    be used here."""
    if args.allowed_origins is None:
        alone = [
            flag
            for flag, given in (
                ("--allowed-methods", args.allowed_methods is not None),
                ("--allowed-headers", args.allowed_headers is not None),
                ("--allow-credentials", args.allow_credentials),
            )
            if given
        ]
        if alone:
            raise ValueError(f"{', '.join(alone)}: CORS is off without --allowed-origins")
    if args.otlp_traces_endpoint is not None:
        # only here: frontend.tracing imports the HTTP stack, which the engines start without
        from frontend.tracing import check_tracing_endpoint

        check_tracing_endpoint(args.otlp_traces_endpoint)


def cors_settings(args: argparse.Namespace) -> CorsSettings | None:
    if args.allowed_origins is None:
        return None
    return CorsSettings(
        allow_origins=args.allowed_origins,
        allow_methods=args.allowed_methods if args.allowed_methods is not None else ["*"],
        allow_headers=args.allowed_headers if args.allowed_headers is not None else ["*"],
        allow_credentials=args.allow_credentials,
    )
