"""LoRA through the real server: `tandem serve --enable-lora` on a tiny random Llama (real
processes, the official `openai` client), adapters written by peft. /v1/models lists them with
their base as parent; "model": NAME gives HF + PEFT's tokens; an unknown name is a 404 in the
OpenAI shape; the load/unload routes are refused unless enabled, behind the API key, refuse bad
adapters naming the problem, and an unload under load lets the requests in flight finish; an
adapter loaded at run time serves at --tensor-parallel-size 2."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.lora_fixtures import peft_greedy, write_adapter
from tests.server_fixture import Server, start_server, stop_server, wait_engine_idle
from tests.test_resume import kill_mid_generation, metric, run_undisturbed, wait_restarted

pytestmark = pytest.mark.slow

PROMPT = [5, 17, 42, 99, 3, 1000, 2000]
NEW_TOKENS = 8
KEY = "lora-key"
ARGS = ["--max-num-seqs", "8", "--num-kv-blocks", "64", "--max-model-len", "256"]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-http")
    return {
        "sql": write_adapter(tiny_model_dir, root / "sql", seed=11),
        "chat": write_adapter(
            tiny_model_dir, root / "chat", seed=12, r=8, use_rslora=True,
            target_modules=["q_proj", "v_proj", "down_proj"],
        ),
        "wide": write_adapter(tiny_model_dir, root / "wide", seed=13, r=32),  # over rank 16
    }  # fmt: skip


@pytest.fixture(scope="module")
def expected(tiny_model_dir: Path, adapters: dict[str, Path], default_model_dir: Path) -> dict:
    """The text HF + PEFT generates for PROMPT, per adapter (None: the base model)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    out = {}
    for name in (None, "sql", "chat"):
        folder = None if name is None else adapters[name]
        ids = peft_greedy(tiny_model_dir, folder, PROMPT, NEW_TOKENS)
        out[name] = tok.decode(ids, skip_special_tokens=True)
    assert len({out[None], out["sql"], out["chat"]}) == 3  # the adapters change the output
    return out


@pytest.fixture(scope="module")
def fixed_server(
    tiny_model_dir: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """Two adapters named at start (one in vLLM's JSON form), runtime updates off (the
    default)."""
    chat = {"name": "chat", "path": str(adapters["chat"]), "base_model_name": str(tiny_model_dir)}
    modules = [f"sql={adapters['sql']}", json.dumps(chat)]
    extra = ["--enable-lora", "--max-loras", "1", "--lora-modules", *modules]
    server = start_server(
        tmp_path_factory.mktemp("serve-lora"), model=str(tiny_model_dir), args=ARGS, extra=extra
    )
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def dynamic_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """No adapter at start; runtime updates on, behind an API key."""
    extra = ["--enable-lora", "--max-loras", "2", "--allow-runtime-lora-updates"]
    server = start_server(
        tmp_path_factory.mktemp("serve-lora-dyn"),
        api_key=KEY,
        model=str(tiny_model_dir),
        args=ARGS,
        extra=extra,
    )
    yield server
    stop_server(server)


def client_of(server: Server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key=server.api_key or "none", max_retries=0,
        timeout=120,
    )  # fmt: skip


def complete(client: openai.OpenAI, model: str) -> str:
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert out.model == model
    return out.choices[0].text


def post(server: Server, route: str, body: dict[str, Any], key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.base_url}{route}", json=body, headers=headers, timeout=60)


def test_models_lists_adapters_with_their_parent(
    fixed_server: Server, tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    cards = {m.id: m for m in client_of(fixed_server).models.list().data}
    base = str(tiny_model_dir)
    assert set(cards) == {base, "sql", "chat"}
    assert getattr(cards[base], "parent", None) is None
    for name in ("sql", "chat"):
        assert getattr(cards[name], "parent", None) == base
        assert getattr(cards[name], "root", None) == str(adapters[name].resolve())


def test_a_completion_with_an_adapter_gives_its_tokens(
    fixed_server: Server, tiny_model_dir: Path, expected: dict
) -> None:
    """Each adapter, the base, then the first adapter again (one slot: each swap reloads it)."""
    client = client_of(fixed_server)
    for name in ("sql", None, "chat", "sql"):
        assert complete(client, name or str(tiny_model_dir)) == expected[name], name
    messages = [{"role": "user", "content": "hi"}]
    chats = {
        name: client.chat.completions.create(
            model=name,
            messages=messages,
            max_tokens=6,
            temperature=0,  # type: ignore[arg-type]
        )
        for name in ("sql", str(tiny_model_dir))
    }
    assert chats["sql"].model == "sql"
    answer = chats["sql"].choices[0].message.content
    assert answer != chats[str(tiny_model_dir)].choices[0].message.content
    # The Responses API runs the same chat with the same adapter.
    response = client.responses.create(model="sql", input="hi", max_output_tokens=6, temperature=0)
    assert response.model == "sql" and response.output_text == answer


def test_mixed_concurrent_requests_each_get_their_own_tokens(
    fixed_server: Server, tiny_model_dir: Path, expected: dict
) -> None:
    """Requests of two adapters and the base at once, with one slot: each waits its turn for
    the slot (none fails) and gets the tokens it gets alone."""
    names = ["sql", "chat", None] * 3

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(
            base_url=f"{fixed_server.base_url}/v1", api_key="none", max_retries=0, timeout=120
        )
        async with client:
            outs = await asyncio.gather(
                *(
                    client.completions.create(
                        model=name or str(tiny_model_dir),
                        prompt=PROMPT,
                        max_tokens=NEW_TOKENS,
                        temperature=0,
                        extra_body={"ignore_eos": True},
                    )  # fmt: skip
                    for name in names
                )
            )
        return [o.choices[0].text for o in outs]

    assert asyncio.run(run()) == [expected[name] for name in names]
    wait_engine_idle(fixed_server)


def test_an_unknown_model_is_a_404_in_the_openai_shape(fixed_server: Server) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        complete(client_of(fixed_server), "no-such-adapter")
    body = info.value.body
    assert isinstance(body, dict)
    assert body["code"] == "model_not_found" and body["param"] == "model"
    assert "no-such-adapter" in body["message"] and "`sql`" in body["message"]


def test_runtime_updates_are_off_by_default(fixed_server: Server, adapters: dict) -> None:
    for route, body in (
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapters["sql"])}),
        ("/v1/unload_lora_adapter", {"lora_name": "sql"}),
    ):
        response = post(fixed_server, route, body, key=None)
        assert response.status_code == 403, response.text
        error = response.json()["error"]
        assert error["code"] == "lora_updates_disabled"
        assert "--allow-runtime-lora-updates" in error["message"]
    assert "sql" in {m.id for m in client_of(fixed_server).models.list().data}


def test_lora_requests_are_counted_per_adapter(fixed_server: Server) -> None:
    complete(client_of(fixed_server), "chat")
    metrics = httpx.get(f"{fixed_server.base_url}/metrics", timeout=10).text
    counts = {
        line.split('lora_name="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("tandem_lora_requests_total{")
    }
    assert counts.get("chat", 0) >= 1 and counts.get("sql", 0) >= 1


def test_the_load_generator_spreads_requests_over_adapters(
    fixed_server: Server, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`tandem bench --model sql,chat,BASE` names each in turn: every request completes and
    each adapter is counted for its third of them."""
    from tests.test_loadgen_live import bench

    def counts() -> dict[str, float]:
        text = httpx.get(f"{fixed_server.base_url}/metrics", timeout=10).text
        return {
            name: metric_value(text, f'tandem_lora_requests_total{{lora_name="{name}"')
            for name in ("sql", "chat")
        }

    before = counts()
    models = f"sql,chat,{tiny_model_dir}"
    args = [
        "--backend", "openai-completions", "--url", fixed_server.base_url, "--model", models,
        "-n", "6", "--input-len", "8", "--output-len", "4", "--ignore-eos", "--no-progress",
    ]  # fmt: skip
    rc, doc = bench(args, tmp_path / "run.json")
    assert rc == 0
    assert doc["runs"][0]["summary"]["completed"] == 6
    assert {name: counts()[name] - before[name] for name in before} == {"sql": 2, "chat": 2}


def metric_value(text: str, prefix: str) -> float:
    """The value of the one sample whose line starts with ``prefix`` (0 where none does)."""
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0


def test_requests_resume_with_their_adapter_after_the_engine_dies(
    fixed_server: Server, tiny_model_dir: Path
) -> None:
    """SIGKILL the engine core mid-generation: the supervisor starts a new one, each request is
    resent with its adapter (the new engine reads the folder again) and ends with the text the
    same request gets undisturbed."""
    models = ["sql", "chat", str(tiny_model_dir)] * 2
    load = [
        {"model": model, "prompt": f"Story {i}: once upon a time", "max_tokens": 200,
         "temperature": 0.0, "ignore_eos": True, "stream": i % 2 == 1}
        for i, model in enumerate(models)
    ]  # fmt: skip
    reference = run_undisturbed(fixed_server, load)
    resumed_before = metric(fixed_server, "tandem_requests_resumed_total")
    old_pid = fixed_server.engine_info()["pid"]
    results = kill_mid_generation(fixed_server, load, old_pid).join()
    assert results == reference
    assert metric(fixed_server, "tandem_requests_resumed_total") > resumed_before
    wait_restarted(fixed_server, old_pid)
    wait_engine_idle(fixed_server)


def test_load_and_unload_at_run_time(
    dynamic_server: Server, adapters: dict[str, Path], expected: dict
) -> None:
    client = client_of(dynamic_server)
    body = {"lora_name": "sql", "lora_path": str(adapters["sql"])}
    assert post(dynamic_server, "/v1/load_lora_adapter", body, key=None).status_code == 401
    with pytest.raises(openai.NotFoundError):
        complete(client, "sql")
    response = post(dynamic_server, "/v1/load_lora_adapter", body)
    assert response.status_code == 200, response.text
    assert "sql" in {m.id for m in client.models.list().data}
    assert complete(client, "sql") == expected["sql"]
    again = post(dynamic_server, "/v1/load_lora_adapter", body)
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    gone = post(dynamic_server, "/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert gone.status_code == 200, gone.text
    with pytest.raises(openai.NotFoundError):
        complete(client, "sql")
    missing = post(dynamic_server, "/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert missing.status_code == 404


def test_a_name_loaded_again_after_its_files_changed_serves_the_new_files(
    dynamic_server: Server, adapters: dict[str, Path], expected: dict, tmp_path: Path
) -> None:
    """Load, unload, replace the folder's files with another adapter's, load again under the
    same name and path (the "retrained, reload it" step): the new files' tokens, not the old
    copy the engine still holds under that name and folder; /v1/models shows the folder."""
    folder = tmp_path / "retrained"
    shutil.copytree(adapters["sql"], folder)
    client = client_of(dynamic_server)
    body = {"lora_name": "retrained", "lora_path": str(folder)}
    assert post(dynamic_server, "/v1/load_lora_adapter", body).status_code == 200
    assert complete(client, "retrained") == expected["sql"]
    cards = {m.id: m for m in client.models.list().data}
    assert cards["retrained"].root == str(folder.resolve())
    assert post(dynamic_server, "/v1/unload_lora_adapter", {"lora_name": "retrained"}).is_success
    shutil.rmtree(folder)
    shutil.copytree(adapters["chat"], folder)
    assert post(dynamic_server, "/v1/load_lora_adapter", body).status_code == 200
    assert complete(client, "retrained") == expected["chat"]
    assert post(dynamic_server, "/v1/unload_lora_adapter", {"lora_name": "retrained"}).is_success
    wait_engine_idle(dynamic_server)


def test_an_adapter_loaded_at_run_time_serves_at_tp2(
    tiny_model_dir: Path,
    adapters: dict[str, Path],
    expected: dict,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Two tensor-parallel ranks (gloo on the CPU): an adapter loaded through the route while
    the server runs gives HF + PEFT's text, the base model beside it its own."""
    extra = ["--tensor-parallel-size", "2", "--enable-lora", "--allow-runtime-lora-updates"]
    server = start_server(
        tmp_path_factory.mktemp("serve-lora-tp2"), model=str(tiny_model_dir), args=ARGS, extra=extra
    )
    try:
        client = client_of(server)
        body = {"lora_name": "chat", "lora_path": str(adapters["chat"])}
        response = post(server, "/v1/load_lora_adapter", body, key=None)
        assert response.status_code == 200, response.text
        assert complete(client, "chat") == expected["chat"]
        assert complete(client, str(tiny_model_dir)) == expected[None]
    finally:
        stop_server(server)


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("wide", "rank 32, over --max-lora-rank 16"),
        ("missing", "no such adapter folder"),
        ("dora", "use_dora"),
        ("inplace", "load_inplace"),
        # Names the wire cannot carry: refused here, not a 500 on each request naming them.
        ("nul", "lora_name must be a non-empty string without NUL"),
        ("long", "lora_name is longer than 4096 characters"),
        ("base", "the base model's name"),
    ],
)
def test_bad_adapters_are_refused_naming_the_problem(
    dynamic_server: Server, adapters: dict[str, Path], tmp_path: Path, case: str, needle: str
) -> None:
    path = adapters["wide"] if case == "wide" else tmp_path / "nothing"
    body: dict[str, Any] = {"lora_name": f"bad-{case}", "lora_path": str(path)}
    if case == "dora":
        path.mkdir()
        config = json.loads((adapters["sql"] / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
        (path / "adapter_model.safetensors").write_bytes(
            (adapters["sql"] / "adapter_model.safetensors").read_bytes()
        )
    if case == "inplace":
        body = {"lora_name": "x", "lora_path": str(adapters["sql"]), "load_inplace": True}
    if case == "base":  # the name of the model the server serves
        base = client_of(dynamic_server).models.list().data[0].id
        body = {"lora_name": base, "lora_path": str(adapters["sql"])}
    if case in ("nul", "long"):
        name = "bad-nul\0" if case == "nul" else "bad-long" + "x" * 4096
        body = {"lora_name": name, "lora_path": str(adapters["sql"])}
    response = post(dynamic_server, "/v1/load_lora_adapter", body)
    assert response.status_code == 400, response.text
    assert needle in json.dumps(response.json()["error"])
    listed = [m.id for m in client_of(dynamic_server).models.list().data]
    assert listed.count(body["lora_name"]) == (case == "base")


def test_unload_under_load_lets_the_requests_in_flight_finish(
    dynamic_server: Server, adapters: dict[str, Path]
) -> None:
    """Six long streams on an adapter; it is unloaded once each has its first token: every
    stream ends normally (length), and a new request naming it is a 404. None hangs: the
    client's timeout would fail the test."""
    body = {"lora_name": "chat", "lora_path": str(adapters["chat"])}
    assert post(dynamic_server, "/v1/load_lora_adapter", body).status_code == 200

    async def stream(client: openai.AsyncOpenAI, started: asyncio.Event) -> tuple[str, int]:
        events = await client.completions.create(
            model="chat", prompt=PROMPT, max_tokens=240, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        reason, chunks = "", 0
        async for event in events:
            chunks += 1
            started.set()
            reason = event.choices[0].finish_reason or reason
        return reason, chunks

    async def run() -> list[tuple[str, int]]:
        client = openai.AsyncOpenAI(
            base_url=f"{dynamic_server.base_url}/v1", api_key=KEY, max_retries=0, timeout=120
        )
        async with client:
            flags = [asyncio.Event() for _ in range(6)]
            tasks = [asyncio.create_task(stream(client, flag)) for flag in flags]
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in flags)), 60)
            unload = await asyncio.to_thread(
                post, dynamic_server, "/v1/unload_lora_adapter", {"lora_name": "chat"}
            )
            assert unload.status_code == 200
            assert not all(task.done() for task in tasks)  # the unload came under load
            with pytest.raises(openai.NotFoundError):
                await client.completions.create(model="chat", prompt=PROMPT, max_tokens=2)
            return await asyncio.wait_for(asyncio.gather(*tasks), 120)

    results = asyncio.run(run())
    assert [reason for reason, _ in results] == ["length"] * 6
    wait_engine_idle(dynamic_server)


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--enable-lora", "--lora-modules", "wide={wide}"], "rank 32, over --max-lora-rank 16"),
        (["--enable-lora", "--lora-modules", "gone=/nonexistent/x"], "no such adapter folder"),
        (["--lora-modules", "sql={sql}"], "--lora-modules needs --enable-lora"),
        (["--enable-lora", "--lora-modules", "sql"], "give NAME=PATH"),
        (["--enable-lora", "--lora-modules", "a={sql}", "a={sql}"], "given twice"),
        (["--enable-lora", "--lora-modules", "L" * 4097 + "={sql}"], "longer than 4096"),
        (["--enable-lora", "--lora-modules", '{{"name": "a"'], "not valid JSON"),
        (["--enable-lora", "--lora-modules", '{{"name": "a", "path": 3}}'], "'path' must be"),
        (
            ["--enable-lora", "--lora-modules", '{{"name": "a", "path": "{sql}", "rank": 8}}'],
            "unknown key 'rank'",
        ),
        (
            [
                "--enable-lora",
                "--lora-modules",
                '{{"name": "a", "path": "{sql}", "base_model_name": "other/model"}}',
            ],
            "base_model_name 'other/model' is not the served model",
        ),
        (["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "1"], "--max-cpu-loras"),
        (["--max-lora-rank", "64"], "--max-lora-rank sizes the adapter slots: it needs"),
        (
            ["--enable-lora", "--allow-runtime-lora-updates", "--api-servers", "2"],
            "--api-servers > 1",
        ),
    ],
)
def test_bad_lora_flags_stop_the_server_before_it_starts(
    tiny_model_dir: Path, adapters: dict[str, Path], flags: list[str], needle: str
) -> None:
    import subprocess
    import sys

    given = [f.format(wide=adapters["wide"], sql=adapters["sql"]) for f in flags]
    cmd = [sys.executable, "-m", "frontend.cli", "serve", "--model", str(tiny_model_dir), *given]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert needle in done.stderr
