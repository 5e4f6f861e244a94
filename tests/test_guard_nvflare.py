"""The guard as an NVFlare filter, with NVFlare's own classes: added with the Job API and exported with everything it
needs; a blocked result goes on as the server's own weights at next to no aggregation weight (FedAvg and
ScatterAndGather average it in as nothing, and the run goes on), with one warning line and no exception; an honest
result is sent as it is; a dropped one without the rows that read a sample. The slow test runs a job in NVFlare's
simulator, every site blocked in every round."""

from __future__ import annotations

import json
import logging
import sys
import textwrap

import numpy as np
import pytest
import torch

nvflare = pytest.importorskip("nvflare", reason="the NVFlare filter's tests need NVFlare: pip install nvflare")

from nvflare.apis.dxo import DXO, DataKind, from_shareable  # noqa: E402
from nvflare.apis.fl_constant import FLMetaKey  # noqa: E402
from nvflare.apis.fl_context import FLContext  # noqa: E402

from rankaudit.errors import UsageError  # noqa: E402
from rankaudit.guard.decide import Guard  # noqa: E402
from rankaudit.guard.nvflare import BLOCKED_MARK, BLOCKED_WEIGHT  # noqa: E402

# The job's own code, as a user's job folder holds it: the model and the function giving this round's samples.
JOB_CODE = '''
import torch
from torch import nn

class MLP(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.fc1 = nn.Linear(48, width)
        self.fc2 = nn.Linear(width, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))

def batch(count=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(count, 3, 4, 4, generator=generator), torch.randint(10, (count,), generator=generator)

def local_samples(fl_ctx):
    x, y = batch()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)

def one_sample_unit(sample=2):
    """A server's crafted weights: fc1's unit 0 fires for one sample of the batch alone, every other unit for none."""
    torch.manual_seed(0)
    model, (x, y) = MLP(), batch()
    flat = x.flatten(1)
    with torch.no_grad():
        direction = flat[sample] - flat.mean(0)
        scores = flat @ direction
        runner_up = scores[torch.arange(8) != sample].max()
        model.fc1.weight.zero_()
        model.fc1.weight[0] = direction
        model.fc1.bias.fill_(-1.0)
        model.fc1.bias[0] = -(scores[sample] + runner_up) / 2
    return model

class Crafted(MLP):
    """The crafted weights as a model class, for the server's persistor to start from."""

    def __init__(self):
        super().__init__()
        self.load_state_dict(one_sample_unit().state_dict())

def trained(model, steps=1, lr=0.1):
    import copy
    model = copy.deepcopy(model)
    x, y = batch()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model
'''


@pytest.fixture
def job_code(tmp_path, monkeypatch):
    (tmp_path / "guardjob_net.py").write_text(JOB_CODE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "guardjob_net", raising=False)
    import guardjob_net

    import rankaudit.guard.nvflare as guard_nvflare

    monkeypatch.setattr(guard_nvflare, "_RECEIVED", {})
    return guardjob_net


def _filters(**options):
    from rankaudit.guard.nvflare import RankauditGuardFilter

    made = []
    for chain in ("task_data", "task_result"):
        guard_filter = RankauditGuardFilter(model="guardjob_net:MLP", samples="guardjob_net:local_samples", **options)
        guard_filter.set_prop("__chain_type", chain)
        made.append(guard_filter)
    return made


def _weights(model) -> dict:
    return {name: value.detach().numpy().copy() for name, value in model.state_dict().items()}


def _round(job_code, received_model, sent_model, kind=DataKind.WEIGHTS, **options):
    incoming, outgoing = _filters(**options)
    context = FLContext()
    received = _weights(received_model)
    task = DXO(DataKind.WEIGHTS, received).to_shareable()
    assert incoming.process(task, context) is task
    sent = _weights(sent_model)
    data = {name: sent[name] - received[name] for name in sent} if kind == DataKind.WEIGHT_DIFF else sent
    return received, sent, from_shareable(outgoing.process(DXO(kind, data).to_shareable(), context))


def _guard_lines(caplog):
    return [r for r in caplog.records if "rankaudit guard" in r.getMessage()]


def test_a_blocked_result_goes_on_as_the_servers_weights_at_no_weight(job_code, caplog):
    caplog.set_level(logging.INFO)
    crafted = job_code.one_sample_unit()
    received, _, out = _round(job_code, crafted, job_code.trained(crafted))
    assert out.data_kind == DataKind.WEIGHTS and set(out.data) == set(received)
    assert all(np.array_equal(out.data[name], received[name]) for name in received)
    assert out.get_meta_prop(FLMetaKey.NUM_STEPS_CURRENT_ROUND) == BLOCKED_WEIGHT
    assert out.get_meta_prop(BLOCKED_MARK) == "block"
    lines = _guard_lines(caplog)
    assert len(lines) == 1 and lines[0].levelname == "WARNING" and not lines[0].exc_info
    record = json.loads(lines[0].getMessage().split("rankaudit guard: ", 1)[1])
    assert record["action"] == "block" and 2 in record["exact_samples"]


def test_a_blocked_weight_difference_is_zero(job_code):
    crafted = job_code.one_sample_unit()
    _, _, out = _round(job_code, crafted, job_code.trained(crafted), kind=DataKind.WEIGHT_DIFF)
    assert out.data_kind == DataKind.WEIGHT_DIFF
    assert all(not np.any(value) for value in out.data.values())


def test_fedavg_weighs_a_blocked_result_as_nothing(job_code):
    """NVFlare's own weighted average over one honest site (1 step) and one blocked one: the honest update,
    to float32 rounding; and over blocked sites alone, the server's weights, so the global model stays."""
    from nvflare.app_common.aggregators.weighted_aggregation_helper import WeightedAggregationHelper

    crafted = job_code.one_sample_unit()
    _, _, blocked = _round(job_code, crafted, job_code.trained(crafted))
    honest = _weights(job_code.trained(crafted, steps=2))
    helper = WeightedAggregationHelper()
    helper.add(honest, 1.0, "site-1", 1)
    helper.add(blocked.data, blocked.get_meta_prop(FLMetaKey.NUM_STEPS_CURRENT_ROUND), "site-2", 1)
    averaged = helper.get_result()
    assert all(np.allclose(averaged[name], honest[name], rtol=1e-6, atol=1e-7) for name in honest)
    alone = WeightedAggregationHelper()
    for site in ("site-1", "site-2"):
        alone.add(blocked.data, BLOCKED_WEIGHT, site, 1)
    kept = alone.get_result()
    assert all(np.allclose(kept[name], blocked.data[name], rtol=1e-6) for name in kept)


def test_an_honest_result_is_sent_as_it_is_and_a_drop_leaves_no_readable_row(job_code, caplog):
    caplog.set_level(logging.INFO)
    torch.manual_seed(1)
    honest = job_code.MLP(width=64)
    model_args = {"width": 64}
    received, sent, out = _round(job_code, honest, job_code.trained(honest), model_args=model_args)
    decisions = [json.loads(r.getMessage().split("rankaudit guard: ", 1)[1]) for r in _guard_lines(caplog)]
    assert [d["action"] for d in decisions] in (["send"], ["block"])  # a random MLP's unit may fire for one sample
    if decisions[0]["action"] == "send":
        assert all(np.array_equal(out.data[name], sent[name]) for name in sent)
    crafted = job_code.one_sample_unit()
    received, sent, out = _round(job_code, crafted, job_code.trained(crafted), kind=DataKind.WEIGHT_DIFF, action="drop")
    assert out.get_meta_prop(BLOCKED_MARK) is None
    # fc1's crafted unit reads the sample; the output layer's readout of fc1's units shows it too, so it may go.
    assert not np.array_equal(out.data["fc1.weight"], sent["fc1.weight"] - received["fc1.weight"])
    after = {name: torch.as_tensor(received[name] + out.data[name]) for name in received}
    x, y = job_code.batch()
    before = {name: torch.as_tensor(value) for name, value in received.items()}
    assert Guard(job_code.MLP()).decide(before, after, x, y)[0].action == "send"


def test_a_result_the_guard_cannot_check_is_not_sent(job_code, caplog):
    from rankaudit.guard.nvflare import RankauditGuardFilter

    crafted = job_code.one_sample_unit()
    outgoing = RankauditGuardFilter(model="guardjob_net:MLP", samples="guardjob_net:no_such_function")
    outgoing.set_prop("__chain_type", "task_result")
    incoming = RankauditGuardFilter(model="guardjob_net:MLP", samples="guardjob_net:no_such_function")
    incoming.set_prop("__chain_type", "task_data")
    incoming.process(DXO(DataKind.WEIGHTS, _weights(crafted)).to_shareable(), FLContext())
    result = DXO(DataKind.WEIGHTS, _weights(job_code.trained(crafted))).to_shareable()
    out = from_shareable(outgoing.process(result, FLContext()))
    assert all(np.array_equal(out.data[name], value) for name, value in _weights(crafted).items())
    lines = _guard_lines(caplog)
    assert len(lines) == 1 and "no_such_function" in lines[0].getMessage() and not lines[0].exc_info


def test_a_samples_function_that_raises_blocks_with_one_line(job_code, caplog):
    from rankaudit.guard.nvflare import RankauditGuardFilter

    job_code.broken = lambda fl_ctx: 1 / 0
    crafted = job_code.one_sample_unit()
    incoming = RankauditGuardFilter(model="guardjob_net:MLP", samples="guardjob_net:broken")
    outgoing = RankauditGuardFilter(model="guardjob_net:MLP", samples="guardjob_net:broken")
    incoming.set_prop("__chain_type", "task_data")
    outgoing.set_prop("__chain_type", "task_result")
    incoming.process(DXO(DataKind.WEIGHTS, _weights(crafted)).to_shareable(), FLContext())
    result = DXO(DataKind.WEIGHTS, _weights(job_code.trained(crafted))).to_shareable()
    out = from_shareable(outgoing.process(result, FLContext()))
    assert out.get_meta_prop(BLOCKED_MARK) == "block"
    lines = _guard_lines(caplog)
    assert len(lines) == 1 and "ZeroDivisionError" in lines[0].getMessage() and not lines[0].exc_info


def test_python_objects_are_named_by_import_path_or_refused(job_code):
    from rankaudit.guard.nvflare import RankauditGuardFilter

    named = RankauditGuardFilter(model=job_code.MLP, samples=job_code.local_samples)
    assert (named.model, named.samples) == ("guardjob_net:MLP", "guardjob_net:local_samples")
    with pytest.raises(UsageError, match="import path"):
        RankauditGuardFilter(model=job_code.MLP(), samples="guardjob_net:local_samples")
    with pytest.raises(UsageError, match="import path"):
        RankauditGuardFilter(model="guardjob_net:MLP", samples=lambda fl_ctx: None)
    with pytest.raises(UsageError, match="action"):
        RankauditGuardFilter(model="guardjob_net:MLP", samples="guardjob_net:local_samples", action="warn")


def test_the_job_api_exports_the_filter_in_both_chains_with_all_its_arguments(job_code, tmp_path):
    from nvflare.job_config.api import FedJob

    from rankaudit.guard.nvflare import RankauditGuardFilter

    job = FedJob(name="guarded", min_clients=1)
    guard_filter = RankauditGuardFilter(
        model="guardjob_net:MLP", samples="guardjob_net:local_samples", model_args={"width": 16}, action="drop"
    )
    job.to(guard_filter, "site-1")
    job.export_job(str(tmp_path / "jobs"))
    config = json.loads(
        (tmp_path / "jobs" / "guarded" / "app_site-1" / "config" / "config_fed_client.json").read_text()
    )
    expected = {
        "path": "rankaudit.guard.nvflare.RankauditGuardFilter",
        "args": {
            "model": "guardjob_net:MLP",
            "samples": "guardjob_net:local_samples",
            "model_args": {"width": 16},
            "settings": {"action": "drop"},
        },
    }
    for chain in ("task_data_filters", "task_result_filters"):
        assert config[chain] == [{"tasks": ["train"], "filters": [expected]}], config[chain]
    assert not (tmp_path / "jobs" / "guarded" / "app_site-1" / "custom" / "rankaudit").exists()
    rebuilt = RankauditGuardFilter(**expected["args"])  # as NVFlare's loader builds it on the site
    assert rebuilt._settings.action == "drop" and rebuilt.model_args == {"width": 16}


# ---- NVFlare's simulator ---------------------------------------------------------------------------------------------

CLIENT_SCRIPT = textwrap.dedent(
    """
    import nvflare.client as flare
    import torch
    from guardjob_net import MLP, batch, trained

    flare.init()
    while flare.is_running():
        received = flare.receive()
        model = MLP()
        model.load_state_dict({k: torch.as_tensor(v) for k, v in received.params.items()})
        params = trained(model).state_dict()
        flare.send(flare.FLModel(params=params, meta={"NUM_STEPS_CURRENT_ROUND": 1}))
    """
)


@pytest.mark.slow
def test_every_site_blocked_in_the_simulator_and_the_run_goes_on(job_code, tmp_path):
    """FedAvg from crafted weights, two sites, two rounds: every result is blocked, the run ends normally, the global
    model is the crafted one still, and the log holds one decision line per site and round, none with a traceback."""
    from nvflare.app_common.workflows.fedavg import FedAvg
    from nvflare.app_opt.pt.job_config.model import PTModel
    from nvflare.job_config.api import FedJob
    from nvflare.job_config.script_runner import ScriptRunner

    from rankaudit.guard.nvflare import RankauditGuardFilter

    crafted = job_code.one_sample_unit()
    (tmp_path / "client.py").write_text(CLIENT_SCRIPT)
    job = FedJob(name="guarded", min_clients=2)
    job.to(FedAvg(num_clients=2, num_rounds=2), "server")
    job.to(PTModel(job_code.Crafted()), "server")
    for site in ("site-1", "site-2"):
        job.to(ScriptRunner(script=str(tmp_path / "client.py"), launch_external_process=False), site)
        job.to(RankauditGuardFilter(model="guardjob_net:MLP", samples="guardjob_net:local_samples"), site)
    workspace = tmp_path / "workspace"
    job.simulator_run(str(workspace), threads=2)
    logs = "\n".join(path.read_text(errors="replace") for path in workspace.rglob("log.txt"))
    decisions = [line for line in logs.splitlines() if "rankaudit guard: {" in line]
    assert len(decisions) == 4, logs[-3000:]
    assert all('"action": "block"' in line for line in decisions)
    assert "Traceback" not in logs and "Cannot reach min_responses" not in logs
    assert "Finished FedAvg" in logs
    saved = torch.load(next(workspace.rglob("FL_global_model.pt")), weights_only=False)["model"]
    for name, value in crafted.state_dict().items():  # every site blocked: the global model is the server's own
        assert torch.allclose(torch.as_tensor(saved[name]), value, rtol=1e-5, atol=1e-7), name
