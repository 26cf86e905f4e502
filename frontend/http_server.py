"""One HTTP API process over its engine cores: connect, build the app, run uvicorn.

`tandem serve` runs this in its own process (frontend/serve.py) or, with ``--api-servers N``, in
each of N API processes (frontend/api_processes.py): the same code, told its place among its
siblings by an ``ApiRole``. Startup: load the tokenizer while the engines load their weights,
shake hands with every engine core, build the serving state (the admission gate holds this
process's share of the bound), start the engines' supervisors if this process runs the engines,
announce, and serve until a signal (uvicorn drains the requests in flight first).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn

from common.processes import (
    ParentWatch,
    freeze_startup_heap,
    spread_young_collections,
    stop_on_sigterm,
)
from common.sentence_transformers import default_prompt
from engine_core.model_dir import RANDOM_PREFIX
from frontend.admission import AdmissionGate
from frontend.app import ServerState, build_app, poll_engine_stats
from frontend.constraints import ConstraintChecker
from frontend.engine_pool import EngineGauges, EnginePool
from frontend.engines import EngineSpec, EngineTimeouts, connect_engine, supervise_engines
from frontend.lora_args import lora_on
from frontend.metrics import Metrics
from frontend.operations import cors_settings
from frontend.reasoning import ReasoningParser, get_reasoning_parser
from frontend.serving_context import ServingContext
from frontend.tokenizer import Tokenizer, load_hf_tokenizer
from frontend.tools import tool_support
from frontend.tracing import RequestTracer
from frontend.vision import MediaOptions, VisionProcessor
from protocol.messages import EmbeddingModel, PoolingKind, Ready

if TYPE_CHECKING:
    from frontend.lora import LoraRegistry

logger = logging.getLogger("tandem.frontend")

API_SERVER_HEADER = "x-tandem-api-server"
PARENT_POLL_S = 1.0
GRACEFUL_SHUTDOWN_S = 5
CUT_ANSWER_S = 1.0  # after it: for the requests it cut short to send their answer


@dataclass(frozen=True)
class ApiRole:
    """This API process's place among the ``count`` of `tandem serve --api-servers`; the
    defaults describe the only one, which owns the engines it serves from."""

    index: int = 0
    count: int = 1
    sock: socket.socket | None = None  # the listening socket its parent bound for it
    parent_pid: int | None = None  # stop when that process is gone

    @property
    def alone(self) -> bool:
        return self.count == 1 and self.parent_pid is None


async def serve_http(
    args: argparse.Namespace, model_dir: Path, specs: list[EngineSpec], role: ApiRole = ApiRole()
) -> None:
    """Serve the OpenAI API from ``specs`` until a signal stops uvicorn."""
    timeouts = EngineTimeouts.from_args(args)
    loop = asyncio.get_running_loop()
    hf_tokenizer = loop.run_in_executor(
        None, load_hf_tokenizer, model_dir, args.chat_template
    )  # while the engines load
    # An engine that fails first leaves it unawaited: its error is not to be reported then.
    hf_tokenizer.add_done_callback(lambda f: f.cancelled() or f.exception())
    pool = EnginePool([])
    tasks: list[asyncio.Task[None]] = []
    state: ServerState | None = None
    with stop_on_sigterm() as sigterm:
        try:
            for spec in specs:  # they load in parallel; the handshakes just wait for each in turn
                pool.engines.append(await connect_engine(spec, timeouts))
            state = build_state(args, model_dir, specs, pool, await hf_tokenizer, role)
            supervisors: list[asyncio.Task[None]] = []
            if role.alone and args.restart_engine:
                on_restart = state.serving.metrics.record_restart
                supervisors = supervise_engines(specs, pool, timeouts, on_restart, sigterm.stopping)
            tasks += supervisors
            state.restarts_from_polls = not supervisors  # several API processes, or remote
            server = uvicorn.Server(uvicorn_config(args, build_app(state), role))
            tasks.append(asyncio.ensure_future(poll_engine_stats(state)))
            sigterm.server = server
            if role.parent_pid is not None:
                tasks.append(asyncio.ensure_future(stop_with_parent(server, role.parent_pid)))
            if role.alone:
                announce(args, specs, pool.ready, args.port)
            frozen = freeze_startup_heap()  # before serving: no collection walks start-up again
            logger.debug("froze %d start-up objects out of the garbage collector's reach", frozen)
            spread_young_collections()
            await server.serve(sockets=[role.sock] if role.sock is not None else None)
            await let_cut_requests_answer(server)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await pool.close()
            if state is not None and state.serving.tracer is not None:
                state.serving.tracer.shutdown()  # the spans still batched go out


def build_state(
    args: argparse.Namespace,
    model_dir: Path,
    specs: list[EngineSpec],
    pool: EnginePool,
    hf_tokenizer: Any,
    role: ApiRole,
) -> ServerState:
    """The app's state: the serving context, with this process's share of the admission bound
    (the shares of all API processes add up to the whole, each at least 1)."""
    ready = pool.ready
    name = args.served_model_name or args.model
    waiting = args.max_waiting_requests
    waiting = 3 * ready.max_num_seqs if waiting is None else max(waiting, 0)
    metrics = Metrics(name, args.metrics_name_alias)
    if len(specs) > 1:
        pool.gauges = EngineGauges(metrics.registry, name, len(specs))
    vision = VisionProcessor.load(model_dir, ready.pixel_dtype)
    support, how = tool_support(hf_tokenizer, args.tool_call_parser, vision is not None)
    if role.index == 0:
        logger.info("tools: %s", how)
    serving = ServingContext(
        engine=pool,
        tokenizer=Tokenizer(hf_tokenizer),
        served_model=name,
        max_model_len=ready.max_model_len,
        vocab_size=ready.vocab_size,
        metrics=metrics,
        eos_token_ids=tuple(ready.eos_token_ids),
        admission=AdmissionGate(share_of(ready.max_num_seqs + waiting, role.index, role.count)),
        stream_interval=args.stream_interval,
        constraints=ConstraintChecker(hf_tokenizer, ready.vocab_size, args.grammar_timeout),
        tool_support=support,
        reasoning=reasoning_parser(args, hf_tokenizer),
        max_resumes=resumes_allowed(args, specs),
        resume_timeout_s=args.resume_timeout,
        embedding=ready.embedding,
        embedding_prompt=default_prompt(model_dir) if ready.embedding else "",
        scheduling_policy=ready.scheduling_policy,
        loras=served_loras(args, engine_model_of(args, model_dir)),
        tracer=request_tracer(args, name),
        vision=vision,
        media=MediaOptions.from_args(args),
    )

    return ServerState(
        serving,
        str(model_dir),
        max_body_bytes=args.max_body_bytes,
        api_key=args.api_key,
        engine_info=lambda: engine_info(specs, name, role),
        cors=cors_settings(args),
    )


def engine_model_of(args: argparse.Namespace, model_dir: Path) -> str:
    """What the engine cores load (frontend/serve.py): a random preset by name, else the folder
    the model resolved to."""
    return args.model if args.model.startswith(RANDOM_PREFIX) else str(model_dir)


def served_loras(args: argparse.Namespace, engine_model: str) -> LoraRegistry | None:
    """The adapters served by name, or None where LoRA is off (frontend/lora.py, which imports
    torch, is imported only where it is on)."""
    if not lora_on(args):
        return None
    from frontend.lora import lora_registry

    return lora_registry(args, engine_model)


def request_tracer(args: argparse.Namespace, model: str) -> RequestTracer | None:
    """This process's tracer (each API process exports its own spans), or None: not traced."""
    endpoint = args.otlp_traces_endpoint
    return None if endpoint is None else RequestTracer(endpoint, model)


def engine_info(specs: list[EngineSpec], model: str, role: ApiRole) -> dict[str, Any]:
    """GET /v1/engine: where the engine cores listen (their pids change with each restart)."""
    info: dict[str, Any] = {"address": str(specs[0].address), "pid": specs[0].pid}
    info["model"] = model
    if len(specs) > 1:
        info["engines"] = [{"address": str(s.address), "pid": s.pid} for s in specs]
    if not role.alone:
        info.update(api_server=role.index, api_server_pid=os.getpid())
    return info


def resumes_allowed(args: argparse.Namespace, specs: list[EngineSpec]) -> int:
    """--max-request-resumes, unless no engine can come back: engines we run, not restarted
    (--no-restart-engine), and only one of them (with several, the others take the requests)."""
    ours = [s for s in specs if s.process is not None or s.pid_file is not None]
    if not args.restart_engine and len(ours) == len(specs) == 1:
        return 0
    return args.max_request_resumes


def describe_embedding(model: EmbeddingModel) -> str:
    """An embedding model for the start-up line: "embeds: 1024 values, last-token, normalised"."""
    pooling = {PoolingKind.LAST: "last-token", PoolingKind.MEAN: "mean"}[model.pooling]
    normalised = ", normalised" if model.normalize else ""
    return f"embeds: {model.size} values, {pooling} pooling{normalised}"


def share_of(total: int, index: int, count: int) -> int:
    """Part ``index`` of ``total`` split in ``count`` parts that differ by at most one."""
    return max(1, total // count + (1 if index < total % count else 0))


def http_parser() -> str:
    """uvicorn's HTTP/1.1 implementation here: 'httptools' (C, a dependency) where installed,
    else 'h11' (pure Python), which costs a busy API process a share of its streaming rate;
    the fallback is logged as a warning, so that a slow server says why."""
    if importlib.util.find_spec("httptools") is not None:
        return "httptools"
    logger.warning(
        "httptools is not installed (a dependency of tandem): HTTP is parsed by h11, in pure "
        "Python, and one API process streams less; pip install httptools"
    )
    return "h11"


def uvicorn_config(args: argparse.Namespace, app: Any, role: ApiRole) -> uvicorn.Config:
    """The one uvicorn configuration; API processes tag their responses with their index."""
    headers = [] if role.alone else [(API_SERVER_HEADER, str(role.index))]
    return uvicorn.Config(
        app,
        http=http_parser(),
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        access_log=args.access_log,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        headers=headers,
        # No lifespan task: the app has no start-up or shutdown of its own (serve_http runs the
        # stats poll), and on a second Ctrl-C uvicorn skips the shutdown event, so that task was
        # cancelled as the loop closed, and its traceback logged at ERROR.
        lifespan="off",
    )


async def let_cut_requests_answer(server: uvicorn.Server) -> None:
    """Past its graceful shutdown uvicorn cancels the requests still running and returns without
    waiting for them: give their handlers the moment they need to send the 503 they answer with
    (``until_disconnect``, ``AdmittedStreamingResponse``) before the clean-up goes on."""
    tasks = set(server.server_state.tasks)
    if tasks:
        await asyncio.wait(tasks, timeout=CUT_ANSWER_S)


async def stop_with_parent(server: uvicorn.Server, parent_pid: int) -> None:
    """Stop the server once the parent is gone (the death signal covers that on Linux; this
    covers what it misses)."""
    parent = ParentWatch(parent_pid)
    while parent.alive():
        await asyncio.sleep(PARENT_POLL_S)
    server.should_exit = True


def announce(
    args: argparse.Namespace,
    specs: list[EngineSpec],
    ready: Ready,
    port: int,
    api_pids: list[int] | None = None,
) -> None:
    """The start-up lines: the HTTP address, and each engine core's raw ZMQ address."""
    host = f"[{args.host}]" if ":" in args.host else args.host
    several = len(specs) > 1
    cores = f", {len(specs)} engine cores" if several else ""
    http = f"  OpenAI API:  http://{host}:{port}/v1"
    if api_pids:
        http += f" ({len(api_pids)} API processes: pids {', '.join(map(str, api_pids))})"
    kind = "" if ready.embedding is None else f", {describe_embedding(ready.embedding)}"
    lines = [
        f"tandem serve: model {args.served_model_name or args.model}{cores} "
        f"(max_model_len {ready.max_model_len}, {ready.num_kv_blocks} KV blocks"
        f"{' in all' if several else ''}{kind})",
        http,
    ]
    for spec in specs:
        name = f"engine core {spec.index}" if several else "engine core"
        where = f"pid {spec.pid}" if spec.process is not None else "remote"
        raw = f"raw client: tandem client --address {spec.address}"
        lines.append(f"  {name}: {spec.address} ({where}); {raw}")
    print("\n".join(lines), flush=True)


def reasoning_parser(args: argparse.Namespace, hf_tokenizer: Any) -> ReasoningParser | None:
    """The parser --reasoning-parser names, bound to the model's tokenizer, or None."""
    name = getattr(args, "reasoning_parser", None)
    return None if name is None else get_reasoning_parser(name, hf_tokenizer)
