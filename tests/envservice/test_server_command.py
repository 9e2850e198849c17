"""``turnrl serve-env`` as a command (its options, its port, its logs, its exit) and ``env.remote`` in eval, train and
SFT: envs stepped on a server by the commands that use them."""

from __future__ import annotations

import argparse
import json
import signal

import httpx
import numpy as np
import pytest

from tests.envs.toy_envs import CorridorWithExtras
from tests.envservice.env_helpers import (
    FAST,
    GATED,
    PROBE,
    ServerProcess,
    env_server,
    open_one,
    post,
)
from turnrl.envs import make
from turnrl.envs.contract import observation_key, optional_methods
from turnrl.envservice.client import remote_env_factory
from turnrl.envservice.options import add_arguments
from turnrl.envservice.protocol import RemoteEnvError
from turnrl.envservice.server import main


def test_the_command_lines_defaults_serve_loopback_without_a_token():
    """Bad limits are usage errors of the parser (test_options.py); a port that cannot be had, below."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    assert (args.host, args.port, args.envs, args.token) == ("127.0.0.1", 8100, None, None)


def test_a_busy_port_or_a_bad_host_is_one_line_before_serving(monkeypatch, capsys):
    import socket

    import uvicorn

    def never(*args, **kwargs):
        raise AssertionError("uvicorn started although the port cannot be had")

    monkeypatch.setattr(uvicorn.Server, "run", never)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(parser.parse_args(["--port", str(port)])) == 2
    out, err = capsys.readouterr()
    assert err == f"error: port {port} on 127.0.0.1 is in use (another server, or a serve-env still running); " \
                  "pick a free one with --port N, or stop what listens there\n"
    assert "serving" not in out
    assert main(parser.parse_args(["--host", "no.such.host.", "--port", "0"])) == 2
    out, err = capsys.readouterr()
    assert err.startswith("error: --host 'no.such.host.' is not an address to listen on") and err.count("\n") == 1
    assert "serving" not in out


def test_the_server_listens_on_the_port_it_bound(monkeypatch, capsys):
    import uvicorn

    served: list[tuple[int, int]] = []

    def run(server, sockets=None):  # the socket uvicorn is handed, in place of serving on it
        served.append((sockets[0].getsockname()[1], sockets[0].fileno()))

    monkeypatch.setattr(uvicorn.Server, "run", run)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert main(parser.parse_args(["--port", "0", "--envs", "Sokoban"])) == 0
    ((port, fileno),) = served
    assert port > 0 and fileno >= 0


def test_a_server_with_an_env_stuck_for_good_still_exits_when_stopped():
    """A thread stuck in an env call cannot be stopped; the interpreter joined the worker threads at exit, so a
    server with one never exited on Ctrl-C (its threads are daemons now)."""
    with ServerProcess(extra=["--step-timeout", "0.5"]) as process:
        session = open_one(process.url, GATED)
        assert post(process.url, "/v1/reset", {"items": [{"session": session, "seed": 0}]}).status_code == 200
        stuck = post(process.url, "/v1/step", {"items": [{"session": session, "action": "wait-inc"}]})
        assert stuck.json()["items"][0]["error"]["code"] == "env_timeout"
        assert httpx.get(process.url + "/health").json()["stuck_calls"] == 1
        assert process.process is not None
        process.process.send_signal(signal.SIGINT)
        assert process.process.wait(timeout=30) == 0


@pytest.mark.parametrize("access_log", [False, True])
def test_requests_are_logged_only_with_access_log(access_log, tmp_path):
    """An eval's thousands of requests once logged a line each at info: access logs are asked for by a flag."""
    log = tmp_path / "server.log"
    with ServerProcess(extra=["--access-log"] if access_log else [], log=log) as served:
        env = remote_env_factory(PROBE, {}, [served.url], **FAST)()
        env.reset(seed=0)
        env.step("inc")
        env.close()
        for _ in range(3):
            httpx.get(served.url + "/health", timeout=60.0)
        # A graceful stop: once the process has exited, every line of the requests before it is in the file.
        served.process.send_signal(signal.SIGTERM)
        served.process.wait(timeout=60)
        text = served.log_text()
    assert "Application startup complete" in text  # info-level lines of the server itself are kept
    requests = [line for line in text.splitlines() if '"GET /health' in line or '"POST /v1/' in line]
    assert len(requests) >= 5 if access_log else requests == [], text


def test_server_and_client_read_the_same_token_variable():
    from turnrl.envservice.client import TOKEN_ENV_VAR as client_variable
    from turnrl.envservice.server import TOKEN_ENV_VAR as server_variable

    assert server_variable == client_variable


# --------------------------------------------------------------------------- env.remote in eval and train
def test_eval_with_env_remote_gives_the_summary_of_the_env_in_process(tmp_path):
    from turnrl.config import load_config
    from turnrl.eval_config import EvalConfig
    from turnrl.evaluate import run_eval

    common = ["env.id=Sokoban", "policy=expert", "episodes=6", "agent.max_turns=10"]
    local = run_eval(load_config(EvalConfig, None, [*common, f"out={tmp_path / 'local'}"]))
    with env_server() as url:
        remote = run_eval(load_config(EvalConfig, None, [*common, f"out={tmp_path / 'remote'}",
                                                          f"env.remote=[{url}]"]))
    keys = ("success_rate", "mean_reward", "mean_turns", "action_validity", "errors")
    assert {k: remote[k] for k in keys} == {k: local[k] for k in keys} and remote["success_rate"] == 1.0
    assert (tmp_path / "remote" / "trajectories.jsonl").read_text() == (tmp_path / "local" /
                                                                         "trajectories.jsonl").read_text()


def test_env_remote_without_a_server_is_a_config_error_before_anything_runs(tmp_path):
    from tests.serve.running import free_port
    from turnrl.config import ConfigError, load_config
    from turnrl.eval_config import EvalConfig
    from turnrl.evaluate import run_eval

    config = load_config(EvalConfig, None, ["env.id=Sokoban", "policy=expert", "episodes=2", f"out={tmp_path}",
                                            f"env.remote=[http://127.0.0.1:{free_port()}]"])
    with pytest.raises(ConfigError, match="env.remote"):
        run_eval(config)
    assert not any(tmp_path.iterdir())


def test_a_training_run_steps_its_envs_on_a_server(tiny_model_dir, tmp_path, capsys):
    from turnrl.config import load_config
    from turnrl.training.commands import train
    from turnrl.training.train_config import TrainConfig

    with env_server() as url:
        config = load_config(TrainConfig, None, [
            f"model.path={tiny_model_dir}", "model.device=cpu", "model.dtype=float32", f"run.output_dir={tmp_path}",
            "run.name=remote", "run.steps=1", "run.tensorboard=false", "env.id=FrozenLake", f"env.remote=[{url}]",
            "agent.format=no_think", "agent.max_turns=2", "sampling.max_new_tokens=8", "groups.n_groups=2",
            "groups.group_size=2", "validation.episodes=2", "sft.enabled=false",
            "algorithm.mini_batch_size=4", "algorithm.micro_batch_size=4"])
        summary = train(config)
        assert httpx.get(url + "/health").json()["sessions"] == 0, "the run closed its sessions"
    assert f"remote: FrozenLake (envs served at {url}), gae," in " ".join(capsys.readouterr().out.split())
    assert "val_success_after_rl" in summary
    records = [json.loads(line) for line in (tmp_path / "remote" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("rollout/episodes") == 4.0 and r.get("rollout/errors") == 0.0 for r in records)


def test_sft_on_expert_demos_from_a_server_closes_its_sessions(tiny_model_dir, tmp_path):
    from turnrl.config import load_config
    from turnrl.training.commands import sft_only
    from turnrl.training.train_config import TrainConfig

    with env_server() as url:
        config = load_config(TrainConfig, None, [
            f"model.path={tiny_model_dir}", "model.device=cpu", "model.dtype=float32", f"run.output_dir={tmp_path}",
            "run.name=sft", "run.tensorboard=false", "env.id=FrozenLake", f"env.remote=[{url}]",
            "sft.episodes=4", "sft.epochs=1", "sft.batch_size=4", "sft.micro_batch_size=4"])
        sft_only(config)  # the preflight's solver check and the demos both play on the server
        assert httpx.get(url + "/health").json()["sessions"] == 0


def test_a_remote_env_tells_eval_its_budget(tmp_path):
    from turnrl.config import load_config
    from turnrl.eval_config import EvalConfig
    from turnrl.evaluate import run_eval

    with env_server() as url:
        summary = run_eval(load_config(EvalConfig, None, ["env.id=Sokoban", "policy=expert", "episodes=2",
                                                           f"out={tmp_path}", f"env.remote=[{url}]"]),
                           budget_from_env=True)
    assert summary["budget"]["max_turns"] == make("Sokoban").action_budget()


CORRIDOR, EXTRAS = "tests.envs.toy_envs:Corridor", "tests.envs.toy_envs:CorridorWithExtras"


def test_a_remote_env_forwards_the_optional_methods_its_env_offers_and_defaults_the_others():
    with env_server(envs=[CORRIDOR, EXTRAS]) as url:
        remote, local = remote_env_factory(EXTRAS, {}, [url], **FAST)(), CorridorWithExtras()
        for env in (remote, local):
            env.reset(seed=0)
            env.step("Right")
        offered = optional_methods(remote)
        assert offered.state_key() == local.state_key() and offered.text() == local.text()
        assert offered.action_budget() == local.action_budget() and np.array_equal(offered.image(), local.image())
        assert offered.canonical_action("right") is None  # not a query: the remote env offers no spellings
        bare = remote_env_factory(CORRIDOR, {}, [url], **FAST)()
        obs, _ = bare.reset(seed=0)
        offered = optional_methods(bare)
        assert offered.state_key() == observation_key(obs) and offered.text() == ""
        assert offered.action_budget() is None
        with pytest.raises(RemoteEnvError, match=r"image\(\) failed: NotImplementedError: the env offers no image"):
            offered.image()
        remote.close()
        bare.close()
