"""One GRPO step of the same agent on the same tasks: ours against TRL's GRPOTrainer.

    python -m bench trl [--adapter DIR] [--sft-steps 48] [--seed 0]    # needs `pip install trl peft`

The start. The embedded base model makes no tool calls, so both sides start from a warm-started policy:
the embedded model with an adapter (--adapter DIR, a saved adapter or run folder; else --sft-steps of our
SFT warm start, run here first) merged into its weights and saved once (runs/bench_trl/start). Each side
then puts a fresh LoRA on those weights, rank 16, alpha 32, the same seven projections, B = 0 so both start
as exactly the merged model: ours (lora.py) and TRL's (peft). Merging keeps the question of how each side
would load the other's adapter out of the comparison.

The step. Each side runs in a fresh process (`--child ours|trl`), so its peak resident set (ru_maxrss,
model load included) is its own, on the same 2 train tasks (train.sample_tasks, --seed), 8 trajectories
each, with train.py's CPU defaults: max_turns 4, max_new_tokens 128 a turn, max_context 2048,
temperature 0.5 (the update's logits divided by it too), lr 1e-4 (AdamW, no weight decay, gradient norm
clipped at 1), clip 0.2 / 0.28, no KL, DAPO's token-level loss, advantages normalised by the group's std,
8 trajectories a forward, gradient checkpointing on, fp32 on a CPU (sampling too), the same attention
kernel (both load
through lora.load_model); TRL's completion budget is max_context less the longer prompt. The reward is
the correctness bonus alone, 1 for an execution-correct submission, 0 else (ours: --judge none,
--bonus 1; TRL: the environment's get_reward). Ours is
train_step's phases 2) to 5) on those tasks (train.setup, train.rollout, train.score_groups,
grpo.make_batch, grpo.grpo_step). TRL's is GRPOTrainer.train for max_steps=1, with our SQLEnv behind its
`environment_factory` (SQLToolEnv, here only) and the prompt our rollouts start from, token for token
(asserted): the system prompt with the tools described in it, the worked example, the question.

Making TRL's episodes end where ours do (TRL 1.16):
- SmolLM2's template ignores tools=, which TRL refuses; TRL's tokenizer gets TRL_TEMPLATE instead, the
  same ChatML for every message ours renders, plus assistant tool_calls as our `<tool_call>` text, and
  Qwen3's response template from TRL (ChatML, `<tool_call>{json}</tool_call>`) to parse the calls.
- A turn ends at `</tool_call>` (generation stop string, as ours) or at `<|im_end|>` or 128 tokens.
- An episode ends after an accepted submit_answer or max_turns turns (TurnLimitedGRPOTrainer: no next
  turn is generated; the tool of the last turn still runs, as ours), or a turn without a tool call.

What still differs (the table's last line names the first two):
- TRL trains one token per tool-call turn ours does not: the `<|im_end|>` that closes the turn, which its
  generate() writes as padding after the stop string; ours appends it with the tool's answer, mask 0.
  The sampled tokens below are those sampled on each side, that `<|im_end|>` not counted.
- TRL forwards every trajectory, a group with no signal included (its advantages 0), padded to the
  batch's longest prompt and completion; ours forwards only trajectories with a nonzero advantage, each
  trained group's tree once (shared turns once). TRL's DAPO normaliser counts every sampled token of the
  step, zero-advantage trajectories' too; ours those of the trajectories it trains.
- TRL's "old" log-probs are the update's own, detached (one step on the batch: ratio 1); ours are the
  rollout's, so its ratio is 1 up to the sampler's numerical gap.
- A malformed tool call ends TRL's episode (no call parsed); ours answers it with an error and goes on.
  A call with wrong arguments or an unknown tool: TRL answers with its own error text, ours with SQLEnv's.
- TRL shuffles the step's 16 rollouts into 2 micro-batches of 8; ours forwards a group (8) at a time.
- The two sides sample with different random streams: the same policy and tasks, not the same tokens,
  so each normalised figure divides its side's time by its side's own count: rollout seconds per sampled
  token, update seconds per trained token and per token forwarded.
The step's wall time is split into rollout (generation and tool calls; TRL's _generate_and_score_completions,
rewards and advantages included) and the update (the rest of the step: ours scoring, advantages and
grpo_step; TRL the forwards, backwards and optimizer step).
"""
import functools
import json
import os
import random
import resource
import shutil
import time
from dataclasses import replace

import torch

try:
    import peft
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl.chat_template_utils import qwen3_template
except ImportError as e:
    raise SystemExit(f"python -m bench trl compares against TRL's GRPOTrainer ({e}): "
                     f"pip install trl peft") from e

import agentrl
import grpo
import lora
import sql_env
import train
from bench.common import in_fresh_process
from bench.update import forwarded_tokens, scripted_rewards

OUT = os.path.join("runs", "bench_trl")
SIDES = ("ours", "trl")

# SmolLM2's chat template, and an assistant message's tool_calls written as our tool-call text
TRL_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face'"
    " + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{% if message.tool_calls is defined and message.tool_calls %}{% for call in message.tool_calls %}"
    "{{ '<tool_call>' + {'name': call.function.name, 'arguments': call.function.arguments} | tojson"
    " + '</tool_call>' }}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def bench_trl(args):
    """The parent: the start's weights, each side in its own process, the table."""
    if args.child:
        print(json.dumps(run_side(args.child, os.path.join(OUT, "start"), bench_config(args.seed))))
        return
    save_start(args)
    results = {}
    for side in SIDES:
        print(f"running {side} ...", flush=True)
        results[side] = in_fresh_process(["trl", "--seed", str(args.seed)], side, hand_back_memory=False)
    print_table(results, args)


def bench_config(seed, **changes) -> train.Config:
    """train.py's CPU defaults with the judge off (correctness alone, bonus 1): both sides' settings."""
    return train.Config(**{"judge": "none", "bonus": 1.0, "sft_steps": 0, "eval_size": 1, "seed": seed,
                           "out": os.path.join(OUT, "ours"), **changes})


def bench_tasks(config) -> list:
    """The step's tasks, the same on both sides: train.py's draw for a fresh run's first step."""
    tasks = sql_env.load_tasks(config.data, config.train_split)
    by_tier = {tier: [t for t in tasks if t.difficulty == tier] for tier in {t.difficulty for t in tasks}}
    return train.sample_tasks(by_tier, {"tiers": {}, "tasks": {}}, config.groups_per_step,
                              random.Random(config.seed))


def save_start(args):
    """runs/bench_trl/start: the embedded model with the warm start merged in (the module docstring)."""
    config = bench_config(args.seed, sft_steps=args.sft_steps, out=OUT)
    model, tokenizer = lora.load_model()
    if args.adapter:
        folder = lora.find_adapter(args.adapter)
        lora.load_adapter(model, folder)
        print(f"start: the embedded model + {folder}, merged")
    else:
        print(f"start: the embedded model + {args.sft_steps} steps of our SFT warm start, merged")
        lora.apply_lora(model, r=config.lora_r, alpha=config.lora_alpha)
        limits = agentrl.Limits(config.max_turns, config.max_new_tokens, config.max_context)
        os.makedirs(OUT, exist_ok=True)
        batches = train.sft_batches(config, tokenizer, sql_env.load_tasks(config.data, config.train_split),
                                    limits)
        train.warm_start(config, model, tokenizer, batches, limits, grpo.GRPOConfig(),
                         os.path.join(OUT, "sft.jsonl"), use_grad_scaler=False)
    start = os.path.join(OUT, "start")
    shutil.rmtree(start, ignore_errors=True)
    lora.merge_adapter(model).save_pretrained(start)
    tokenizer.save_pretrained(start)


def run_side(side, model_dir, config, scripted=False) -> dict:
    """One side's step from the weights in model_dir, in this process; its figures and this process's peak
    resident set. scripted: rewards k / n for the k-th trajectory of a group (tests: a random model solves
    nothing), in place of correctness."""
    assert side in SIDES, f"side: one of {SIDES}, got {side!r}"
    figures = (run_ours if side == "ours" else run_trl)(model_dir, bench_tasks(config), config, scripted)
    return {**figures, "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30}


# ---------------------------------------------------------------- ours: train_step's phases on the tasks
def run_ours(model_dir, tasks, config, scripted=False) -> dict:
    config = replace(config, model=model_dir)
    run = train.setup(config, None)
    seed = config.seed * 100_003 + 1                                 # train_step's for step 1
    t0 = time.perf_counter()
    groups = train.rollout(config, run, tasks, seed)                 # 2) rollouts
    rollout_s = time.perf_counter() - t0
    score = scripted_rewards if scripted else train.score_groups
    rewards, _, _ = score(groups, run.judge, run.rubric, config.bonus)                  # 3) reward
    batch, _ = grpo.make_batch(groups, rewards, train.estimator_of(config), run.grpo_config.max_tokens)   # 4)
    stats = run.update(run.model, run.optimizer, batch, run.grpo_config, run.scaler)                    # 5)
    update_s = time.perf_counter() - t0 - rollout_s
    trajectories = [t for g in groups for t in g.trajectories]
    # each trained group's tree, each node once per micro-batch through it (forward.tree_logprobs packs)
    forwarded = sum(forwarded_tokens(g, config.micro_batch_size)
                    for g, advantages in zip(batch.groups, batch.advantages) if any(advantages))
    return {"device": str(run.model.device), "rollout_s": rollout_s, "update_s": update_s,
            "trajectories": len(trajectories), "correct": sum(t.correct for t in trajectories),
            "turns": sum(t.num_turns for t in trajectories),
            "sampled_tokens": sum(sum(t.assistant_mask) for t in trajectories),
            "trained_trajectories": stats["sequences"], "trained_tokens": stats["tokens"],
            "loss_tokens": batch.num_tokens, "skipped": stats["skip_reason"],
            "forwarded_tokens": forwarded, "forwarded_positions": forwarded,
            "prompt_tokens": [g.trajectories[0].turns[0][0] for g in groups]}


# ---------------------------------------------------------------- TRL: GRPOTrainer with our environment
class SQLToolEnv:
    """Our SQLEnv behind TRL's environment_factory: reset(task_id=...) starts an episode on that task,
    each public method is a tool (TRL reads its signature and docstring), get_reward is the correctness
    bonus. The observations are SQLEnv.call's, word for word."""

    def __init__(self, tasks_by_id):
        self.tasks_by_id, self.env = tasks_by_id, None

    def reset(self, task_id, **_):
        self.env = sql_env.SQLEnv(self.tasks_by_id[task_id])

    def list_tables(self) -> str:
        """List the tables of the database with their columns."""
        return self.env.call("list_tables", {})

    def describe_table(self, table: str) -> str:
        """Describe one table: its columns, types, keys and a few rows.

        Args:
            table: the table's name
        """
        return self.env.call("describe_table", {"table": table})

    def run_sql(self, query: str) -> str:
        """Run one read-only SQL query and see its result.

        Args:
            query: a SQLite SELECT statement
        """
        return self.env.call("run_sql", {"query": query})

    def submit_answer(self, query: str) -> str:
        """Submit the SQL query whose result answers the question; this ends the episode.

        Args:
            query: a SQLite SELECT statement
        """
        return self.env.call("submit_answer", {"query": query})

    def get_reward(self) -> float:
        return float(self.env.correct)


class TurnLimitedGRPOTrainer(trl.GRPOTrainer):
    """GRPOTrainer whose episodes end where ours do, and which records what its step did. TRL's tool loop
    generates a next turn after every tool call; here an episode whose last tool message is an accepted
    submission, or that has max_turns turns, gets none (an empty completion: the loop drops it)."""

    def __init__(self, *args, max_turns, submitted_reply, ours_prompts, **kwargs):
        super().__init__(*args, **kwargs)
        tokenizer = self.processing_class
        # the stop string needs the tokenizer in generate()
        self.model.generate = functools.partial(self.model.generate, tokenizer=tokenizer)
        self.max_turns, self.ours_prompts = max_turns, ours_prompts
        self.submitted = self._get_tool_suffix_ids([{"role": "tool", "name": "submit_answer",
                                                     "content": submitted_reply}])
        user = [{"role": "user", "content": "?"}]
        header = (tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
                  [len(tokenizer.apply_chat_template(user, tokenize=False)):])
        self.header = agentrl.encode(tokenizer, header)       # <|im_start|>assistant\n: a turn begins
        self.prompt_headers = None
        self.figures = dict.fromkeys(["rollout_s", "sampled_tokens", "turns", "closing_eos"], 0)

    def _turns_begun(self, ids):
        h = len(self.header)
        return sum(ids[i:i + h] == self.header for i in range(len(ids) - h + 1))

    def _episode_over(self, ids):
        return (ids[-len(self.submitted):] == self.submitted
                or self._turns_begun(ids) - self.prompt_headers >= self.max_turns)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations,
                              has_tool_images=False):
        if self.prompt_headers is None:       # the first call: the prompts themselves
            assert [list(ids) for ids in prompt_ids] == self.ours_prompts, "TRL's prompts are not ours"
            self.prompt_headers = self._turns_begun(prompt_ids[0])
        live = [i for i, ids in enumerate(prompt_ids) if not self._episode_over(ids)]
        completions = [[] for _ in prompt_ids]
        if live:
            sampled, logprobs = super()._generate_single_turn(
                [prompt_ids[i] for i in live], images, multimodal_fields, num_generations, has_tool_images)
            assert logprobs is None, "generate() gives no log-probs: the path this subclass knows"
            eos = self.processing_class.eos_token_id
            for i, ids in zip(live, sampled):
                body = ids[:-1] if ids and ids[-1] == eos else ids
                closed = "</tool_call>" in agentrl.decode(self.processing_class, body[-12:])
                # a turn stopped at </tool_call>: generate() pads the row with eos (<|im_end|>, not sampled),
                # unless it was the last row still generating; closed the same way, every time
                completions[i] = body + [eos] if closed else ids
                self.figures["closing_eos"] += closed
                self.figures["sampled_tokens"] += len(body) if closed else len(ids)
                self.figures["turns"] += bool(ids)
        return completions, None

    def _generate_and_score_completions(self, inputs):
        t0 = time.perf_counter()
        out = super()._generate_and_score_completions(inputs)
        self.figures["rollout_s"] += time.perf_counter() - t0
        loss_mask = out["completion_mask"] * out["tool_mask"]                          # (B, C)
        trained = out["advantages"] != 0                                                # (B,)
        self.figures.update(
            trajectories=len(trained), trained_trajectories=int(trained.sum()),
            trained_tokens=int(loss_mask[trained].sum()), loss_tokens=int(loss_mask.sum()),
            forwarded_tokens=int(out["prompt_mask"].sum() + out["completion_mask"].sum()),
            forwarded_positions=out["prompt_mask"].numel() + out["completion_mask"].numel())
        return out


class StepClock(TrainerCallback):
    """The optimizer step's wall time: from its first micro-batch (generation included) to after the step."""

    def on_step_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds = time.perf_counter() - self.start


def run_trl(model_dir, tasks, config, scripted=False) -> dict:
    assert config.loss == "token" and not config.step_credit and config.branching == "none", \
        "TRL's side is set up for train.py's defaults: DAPO's token loss, GRPO's advantages, no branching"
    torch.manual_seed(config.seed)
    model, tokenizer = lora.load_model(model_dir)
    limits = agentrl.Limits(config.max_turns, config.max_new_tokens, config.max_context)
    ours_prompts = [agentrl.Episode.start(task, sql_env.SQLEnv(task), tokenizer, limits).token_ids
                    for task in tasks for _ in range(config.group_size)]
    inline_tools = not agentrl.template_takes_tools(tokenizer)
    dataset = Dataset.from_list(
        [{"prompt": agentrl.build_messages(task, sql_env.SQLEnv.tools, inline_tools), "task_id": task.id}
         for task in tasks])
    tokenizer.chat_template, tokenizer.response_template = TRL_TEMPLATE, qwen3_template
    rollouts = len(tasks) * config.group_size
    assert rollouts % config.micro_batch_size == 0, "the step's rollouts come in whole micro-batches"
    args = trl.GRPOConfig(
        output_dir=os.path.join(OUT, "trl"), max_steps=1, seed=config.seed, report_to="none",
        save_strategy="no", logging_steps=1, use_cpu=model.device.type == "cpu", bf16=False, fp16=False,
        shuffle_dataset=False,
        num_generations=config.group_size, per_device_train_batch_size=config.micro_batch_size,
        gradient_accumulation_steps=rollouts // config.micro_batch_size,
        gradient_checkpointing=config.grad_checkpointing, disable_dropout=True,
        learning_rate=config.lr, lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=grpo.GRPOConfig.max_grad_norm,
        temperature=config.temperature, top_p=1.0, top_k=0, beta=config.kl_coef,
        epsilon=config.clip_low, epsilon_high=config.clip_high, loss_type="dapo",
        scale_rewards="none" if config.no_std_scaling else "group",
        max_completion_length=config.max_context - max(map(len, ours_prompts)),
        max_tool_calling_iterations=config.max_turns,
        generation_kwargs={"max_new_tokens": config.max_new_tokens, "stop_strings": ["</tool_call>"]})
    lora_config = peft.LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=0.0,
                                  target_modules=list(lora.DEFAULT_TARGETS), task_type="CAUSAL_LM")
    n = config.group_size
    reward_funcs = ([lambda completions, **_: [(i % n) / n for i in range(len(completions))]] if scripted
                    else None)                                                # None: the environment's reward
    submitted_reply = sql_env.SQLEnv(tasks[0]).call("submit_answer", {"query": tasks[0].gold_sql})
    clock = StepClock()
    trainer = TurnLimitedGRPOTrainer(
        model, reward_funcs, args=args, train_dataset=dataset, processing_class=tokenizer,
        peft_config=lora_config, callbacks=[clock],
        environment_factory=functools.partial(SQLToolEnv, {task.id: task for task in tasks}),
        max_turns=config.max_turns, submitted_reply=submitted_reply, ours_prompts=ours_prompts)
    trainer.train()
    envs = trainer.environments
    f = trainer.figures
    return {**f, "device": str(model.device), "update_s": clock.seconds - f["rollout_s"],
            "correct": sum(e.env.correct for e in envs), "skipped": "",
            "prompt_tokens": [len(ours_prompts[g * n]) for g in range(len(tasks))]}


# ---------------------------------------------------------------- the table
ROWS = [   # (label, figure key or a function of a side's figures, format)
    ("rollout s (generation + tools)", "rollout_s", "{:.1f}"),
    ("update s", "update_s", "{:.1f}"),
    ("step s", lambda r: r["rollout_s"] + r["update_s"], "{:.1f}"),
    ("trajectories", "trajectories", "{}"),
    ("correct trajectories", "correct", "{}"),
    ("assistant turns", "turns", "{}"),
    ("sampled tokens", "sampled_tokens", "{}"),
    ("trained trajectories (A != 0)", "trained_trajectories", "{}"),
    ("trained tokens (A != 0)", "trained_tokens", "{}"),
    ("tokens the loss is normalised by", "loss_tokens", "{}"),
    ("tokens forwarded in the update", "forwarded_tokens", "{}"),
    ("positions forwarded (padding too)", "forwarded_positions", "{}"),
    ("peak resident memory GiB", "peak_gib", "{:.2f}"),
    ("rollout ms per sampled token", lambda r: 1e3 * r["rollout_s"] / max(1, r["sampled_tokens"]), "{:.1f}"),
    ("update ms per trained token", lambda r: 1e3 * r["update_s"] / max(1, r["trained_tokens"]), "{:.2f}"),
    ("update ms per forwarded token", lambda r: 1e3 * r["update_s"] / max(1, r["forwarded_tokens"]),
     "{:.2f}"),
]


def print_table(results, args):
    ours, theirs = results["ours"], results["trl"]
    tasks, start = len(ours["prompt_tokens"]), args.adapter or f"{args.sft_steps} SFT steps"
    print(f"\none GRPO step: {tasks} tasks (prompts of {ours['prompt_tokens']} tokens) x "
          f"{ours['trajectories'] // tasks} trajectories, the embedded model + {start} merged, a fresh LoRA "
          f"each | {ours['device']} | TRL {trl.__version__}, peft {peft.__version__}")
    print(f"{'figure':<36}{'ours':>10}{'TRL':>10}{'ours/TRL':>10}")
    for label, key, fmt in ROWS:
        a, b = (key(r) if callable(key) else r[key] for r in (ours, theirs))
        ratio = f"{a / b:.2f}" if b else "-"
        print(f"{label:<36}{fmt.format(a):>10}{fmt.format(b):>10}{ratio:>10}")
    if ours["skipped"]:
        print(f"ours trained nothing: {ours['skipped']}")
    print(f"TRL trained {theirs['closing_eos']} <|im_end|> tokens ours does not (one a tool-call turn, "
          f"written by generate() after </tool_call>, not sampled). TRL forwards every trajectory, padded; "
          f"ours each trained group's tree once, nothing of a group without signal. What else differs: "
          f"bench/trl.py's docstring.")
