"""Tests for forward.py: a group's tree forwarded once, on a tiny random Llama. Each packed forward
is checked against forwarding every trajectory whole: the same log-probs, and through policy_loss
(or the SFT loss) the same loss and the same update.

Run: python -m pytest -q tests/test_forward.py
"""
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import agentrl
import forward
import grpo
import lora

VOCAB = 97
NO_SCALER = torch.amp.GradScaler("cpu", enabled=False)
# fp32 through 2 layers of 32 dims: a packed forward and a whole one add the same terms in
# another order (and SDPA with another mask shape), so they agree to a few ulps of the values
# they add, about 1e-6 relative; 1e-4 leaves room for any CPU's kernels, and catches a token
# attending to one token too many (an error of 1e-2 or more here)
RTOL, ATOL = 1e-4, 1e-6


# ---------------------------------------------------------------- fixtures
def tiny_model(seed=0):
    """2-layer random Llama with agentrl's LoRA (B = 0 at init); returns (model, lora params)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True)
    model = LlamaForCausalLM(config).float()
    return model, lora.apply_lora(model, r=4, alpha=8, targets=("q_proj", "v_proj"))


def perturb_lora(params, seed=1):
    """Nonzero B so that the adapter changes the model (and A gets gradients)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(0.3 * torch.randn(p.shape, generator=g))


def trajectory(nodes, g):
    """A trajectory from its nodes, each a list of (tokens, trained) pieces (the first node: the
    prompt; then a sampled turn and the tool's answer, ...), with the turn boundaries and one message
    a node, as the engine records them; rollout log-probs at random."""
    ids, mask, starts = [], [], []
    for k, pieces in enumerate(nodes):
        starts.append((len(ids), k))
        for tokens, trained in pieces:
            ids += tokens
            mask += [int(trained)] * len(tokens)
    logps = [-(0.5 + torch.rand(1, generator=g).item() * 4) * m for m in mask]
    return SimpleNamespace(token_ids=ids, assistant_mask=mask, sampled_logprobs=logps, turns=starts[1:],
                           messages=[{"role": "assistant", "content": str(k)} for k in range(len(nodes))],
                           stop_reason="submitted")


def group(seed=0):
    """A group of 6 as GRPO sees one after SFT: one prompt (12 tokens); trajectories 0-3 take the same
    first turn and read the same tool result (6 sampled, 8 not), then 0 and 1 the same second turn;
    4 and 5 part from the others at the first turn. Each ends with a sampled turn of its own."""
    g = torch.Generator().manual_seed(seed)

    def run(n):
        return torch.randint(3, VOCAB, (n,), generator=g).tolist()
    prompt, first, answer, second, answer2 = run(12), run(6), run(8), run(5), run(2)
    trajectories = []
    for i in range(6):
        nodes = [[(prompt, False)], [(first, True), (answer, False)] if i < 4 else [(run(4), True), (run(3), False)]]
        nodes += [[(second, True), (answer2, False)]] if i < 2 else []
        nodes += [[(run(3 + i), True)]]
        trajectories.append(trajectory(nodes, g))
    return agentrl.make_group(None, trajectories)


def whole_logprobs(model, trajectories):
    """(B, T) log p(token_t | tokens_<t) of each trajectory forwarded alone, right-padded with 0."""
    T = max(len(t.token_ids) for t in trajectories)
    rows = []
    for t in trajectories:
        ids = torch.tensor([t.token_ids])
        logits = model(input_ids=ids).logits[0, :-1].float()
        lp = logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0] * torch.tensor(t.assistant_mask[1:])
        rows.append(torch.nn.functional.pad(lp, (1, T - len(t.token_ids))))
    return torch.stack(rows)


ADVANTAGES = [1.0, -0.5, 0.7, -1.2, 0.0, 0.4]


def trajectories(n=6, seed=0):
    """Trajectories of different lengths that share nothing: a prompt (mask 0), then sampled tokens (mask 1)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt, sampled = 3 + i % 3, 4 + (2 * i) % 7
        ids = torch.randint(0, VOCAB, (prompt + sampled,), generator=g).tolist()
        out.append(trajectory([[(ids[:prompt], False), (ids[prompt:], True)]], g))
    return out


def per_token(trajs, advantages):
    """One advantage a trajectory, on every one of its tokens: the advantages a Batch holds."""
    return [[a] * len(t.token_ids) for t, a in zip(trajs, advantages)]


def as_batch(trajs, advantages, step=None):
    """The trajectories as one group, in the Batch grpo_step takes; the normalizer's counts those of
    the step's trajectories `step` (default: these)."""
    masks = [sum(t.assistant_mask) for t in (step or trajs)]
    return grpo.Batch([agentrl.make_group(None, trajs)], [per_token(trajs, advantages)], len(masks), sum(masks),
                      max(masks))


def step(model, params, config, trajs=None, advantages=ADVANTAGES, lr=0.1, **kw):
    """One grpo_step by SGD on the trajectories as one group."""
    trajs = trajs or trajectories(len(advantages))
    return grpo.grpo_step(model, torch.optim.SGD(params, lr=lr), as_batch(trajs, advantages), config, NO_SCALER, **kw)


# ---------------------------------------------------------------- the tree and its pack
def test_make_group_shares_a_node_exactly_where_trajectories_share_their_turns():
    """The prompt is one node for all; trajectories 0-3's first turn one node; 0-1's second one."""
    tree = group().tree
    (prompt,) = tree.children
    assert prompt.through == list(range(6)) and prompt.start == 0 and len(prompt.tokens) == 12
    shared = [c for c in prompt.children if len(c.through) > 1]
    assert [c.through for c in prompt.children] == [[0, 1, 2, 3], [4], [5]] and len(shared[0].tokens) == 14
    assert [c.through for c in shared[0].children] == [[0, 1], [2], [3]] and shared[0].children[0].start == 26


def test_pack_lays_each_shared_token_once_and_lets_a_token_see_only_its_own_path():
    """A hand-made tree: root [1 2] with children [3] (rows 0, 1) and [4 5] (row 2), [3] with
    children [6] (row 0) and [7] (row 1). Packed depth first: 1 2 3 6 7 4 5, positions 0 1 2 3 3 2 3."""
    Node = agentrl.Node
    leaf6, leaf7 = Node(3, [6], [], [0]), Node(3, [7], [], [1])
    tree = Node(0, [], [], [0, 1, 2], [Node(0, [1, 2], [], [0, 1, 2], [Node(2, [3], [], [0, 1], [leaf6, leaf7]),
                                                                       Node(2, [4, 5], [], [2])])])
    ids, positions, visible, before, index = forward.pack(tree, [0, 1, 2])
    assert ids.tolist() == [1, 2, 3, 6, 7, 4, 5] and positions.tolist() == [0, 1, 2, 3, 3, 2, 3]
    assert before.tolist() == [-1, 0, 1, 2, 2, 1, 5]
    assert index == [[0, 1, 2, 3], [0, 1, 2, 4], [0, 1, 5, 6]]
    assert visible[4].tolist() == [True, True, True, False, True, False, False]     # 7 sees 1 2 3 and itself
    assert visible[6].tolist() == [True, True, False, False, False, True, True]     # 5 sees 1 2 4 and itself
    ids, *_, index = forward.pack(tree, [1])       # only the path of row 1
    assert ids.tolist() == [1, 2, 3, 7] and index == [[0, 1, 2, 3]]


@pytest.mark.parametrize("chunk_size", [None, 5])
def test_tree_logprobs_equal_each_trajectory_forwarded_whole(chunk_size):
    """The packed forward's log-probs at every trained token are those of the trajectory's own forward."""
    model, params = tiny_model()
    perturb_lora(params)
    g = group()
    with torch.no_grad():
        packed = forward.tree_logprobs(model, g.tree, g.trajectories, [0, 2, 3, 5], chunk_size)
        whole = whole_logprobs(model, [g.trajectories[i] for i in (0, 2, 3, 5)])
    torch.testing.assert_close(packed, whole, rtol=RTOL, atol=ATOL)


def count_fed_tokens(model):
    """Tokens each decoder forward is given (a checkpointed layer runs again in the backward)."""
    fed = []
    model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda module, args, kwargs: fed.append(kwargs["hidden_states"].shape[1]), with_kwargs=True)
    return fed


@pytest.mark.parametrize("kl_coef,checkpointing", [(0.0, False), (0.1, False), (0.0, True), (0.1, True)])
@pytest.mark.parametrize("mbs", [1, 4, 8])
def test_a_group_forwarded_as_its_tree_gives_the_update_of_forwarding_every_sequence_whole(mbs, kl_coef, checkpointing):
    """grpo_step on the group (each micro-batch's nodes once, the gradients added by autograd): the
    same loss, KL and update as policy_loss on the whole sequences; a group in one micro-batch is
    fed its distinct tokens only, once per forward."""
    g = group()
    model, params = tiny_model()
    perturb_lora(params)
    b = forward.collate(g.trajectories, per_token(g.trajectories, ADVANTAGES), torch.device("cpu"))
    model.train()
    logps = whole_logprobs(model, g.trajectories)
    with torch.no_grad(), lora.lora_disabled(model):
        refs = whole_logprobs(model, g.trajectories)
    loss, want = grpo.policy_loss(logps, b["old_logprobs"], b["advantages"], b["mask"], kl_coef=kl_coef, ref_logprobs=refs)
    grads = torch.autograd.grad(loss, params)
    expected = [p.detach() - 0.1 * gr for p, gr in zip(params, grads)]

    model, params = tiny_model()
    perturb_lora(params)
    config = grpo.GRPOConfig(micro_batch_size=mbs, kl_coef=kl_coef, max_grad_norm=1e9, gradient_checkpointing=checkpointing)
    fed = count_fed_tokens(model)
    stats = grpo.grpo_step(model, torch.optim.SGD(params, lr=0.1), as_batch(g.trajectories, ADVANTAGES), config,
                           NO_SCALER, reference=lora.lora_disabled(model))
    if mbs == 8 and kl_coef == 0:    # one forward (twice with checkpointing) over the 5 rows with an advantage
        distinct = len(forward.pack(g.tree, [0, 1, 2, 3, 5])[0])
        assert fed == [distinct] * (1 + checkpointing) and distinct < sum(len(g.trajectories[i].token_ids) for i in (0, 1, 2, 3, 5))
    assert stats["loss"] == pytest.approx(loss.item(), rel=RTOL)
    assert stats["kl"] == (None if kl_coef == 0 else pytest.approx(want["kl"], rel=RTOL))
    for want_p, p in zip(expected, params):
        torch.testing.assert_close(p.detach(), want_p, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_sft_step_on_a_tree_equals_the_whole_sequences(checkpointing):
    """sft_step packs the demonstrations' shared turns too: the same loss and update as the NLL of
    every sequence forwarded whole."""
    trajs = group().trajectories
    model, params = tiny_model()
    perturb_lora(params)
    mask = forward.collate(trajs, None, torch.device("cpu"))["mask"]
    model.train()
    loss = -(whole_logprobs(model, trajs) * mask).sum() / mask.sum()
    expected = [p.detach() - 0.1 * gr for p, gr in zip(params, torch.autograd.grad(loss, params))]

    model, params = tiny_model()
    perturb_lora(params)
    config = grpo.GRPOConfig(micro_batch_size=4, max_grad_norm=1e9, gradient_checkpointing=checkpointing)
    stats = grpo.sft_step(model, torch.optim.SGD(params, lr=0.1), trajs, config, NO_SCALER)
    assert stats["sft_loss"] == pytest.approx(loss.item(), rel=RTOL)
    for want_p, p in zip(expected, params):
        torch.testing.assert_close(p.detach(), want_p, rtol=RTOL, atol=ATOL)


def test_chunked_head_gives_the_gradient_of_the_unchunked_one():
    """The lm_head in checkpointed chunks: the same values and LoRA gradients as all at once."""
    g = group()
    grads = []
    for chunk_size in (None, 4):
        model, params = tiny_model()
        perturb_lora(params)
        model.train()
        lp = forward.tree_logprobs(model, g.tree, g.trajectories, list(range(6)), chunk_size)
        grads.append((lp.sum().item(), torch.autograd.grad(lp.sum(), params)))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=RTOL)
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
