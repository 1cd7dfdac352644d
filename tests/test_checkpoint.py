"""checkpoint.py: a run's state on disk. Saving, resuming and pruning run end to end in
test_train.py (a killed and resumed run ends with the unbroken run's adapter); here, what needs
no model."""
import json

import checkpoint


def test_resume_drops_later_steps_and_a_line_cut_short(tmp_path):
    """Resuming at step 1 keeps the records up to it and drops the later ones and a last line cut
    short by a kill mid-write, which would otherwise stop every later read of metrics.jsonl."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "phase": "base"}\n{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.4}\n{"step": 3, "lo')
    checkpoint.truncate_metrics(str(path), 1)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1]


def test_load_restores_what_save_wrote(tmp_path):
    """The adapter, the optimizer's moments, the sampler's state and both RNGs come back as saved,
    from the folder `latest` names; only the newest `keep` step folders stay."""
    import random

    import torch

    import lora
    from conftest import build_tiny_model

    def trained(seed):
        model = build_tiny_model("llama")
        lora.apply_lora(model, r=4, alpha=8)
        optimizer = torch.optim.AdamW(lora.lora_parameters(model), lr=1e-2, weight_decay=0.0)
        torch.manual_seed(seed)
        for p in lora.lora_parameters(model):
            p.grad = torch.randn_like(p)
        optimizer.step()
        return model, optimizer
    model, optimizer = trained(0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    stats = {"tiers": {"easy": 0.4}, "tasks": {"t1": 0.5}}
    for step in range(3):
        checkpoint.save(str(tmp_path), model, optimizer, scaler, step, stats)
    rng = torch.get_rng_state(), random.getstate()
    torch.rand(3), random.random()                   # both RNGs move on after the save
    other, other_optimizer = trained(1)
    step, loaded_stats, folder = checkpoint.load(str(tmp_path), other, other_optimizer, scaler)
    assert (step, loaded_stats, folder) == (2, stats, str(tmp_path / "checkpoints" / "step_0002"))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_0001", "step_0002"]
    assert all(torch.equal(a, b) for a, b in zip(lora.lora_parameters(model), lora.lora_parameters(other)))
    moments = [s["exp_avg"] for s in optimizer.state.values()], [s["exp_avg"] for s in other_optimizer.state.values()]
    assert all(torch.equal(a, b) for a, b in zip(*moments))
    assert torch.equal(torch.get_rng_state(), rng[0]) and random.getstate() == rng[1]
