"""Speculative decoding (Leviathan et al. 2023): a proposer drafts k tokens, the target
verifies them in one forward pass, and both KV caches are cropped to the accepted prefix.

    from quantspec.specdec import make_proposer, speculative_generate
    proposer = make_proposer("self:w4g128", target, tokenizer)   # or "ngram", or a model id
    ids, stats = speculative_generate(target, proposer, input_ids, max_new_tokens=128, k=4)
    stats.to_dict()  # acceptance rate, mean accepted per call, histogram, tokens/s
    # token trees (EAGLE-2 dynamic or static shapes), from any draft that grows them
    ids, stats = speculative_generate(target, make_proposer("eagle:heads/smol", target), input_ids,
                                      k=4, tree=TreeSpec("dynamic", total=16, top_k=4, depth=4))

Modules: sampling (shared temperature/top-k/top-p), verify (pure greedy and rejection
sampling, chains and trees), tree (TokenTree, TreeSpec, grow_tree), proposers (the Proposer
base, DraftModel, NGram), eagle/ (EAGLE heads: training, drafting, vLLM export), selfdraft
(QuantizedSelf), loop
(speculative_generate), adaptive (draft length), stats, factory (make_proposer), bench (target
vs ours vs transformers' assisted generation). The batched KV cache with per-row rollback is
``runtime.kv``.
"""

from .adaptive import AdaptiveK, FixedK
from .factory import check_same_vocab, make_proposer, parse_scheme
from .loop import speculative_generate
from .proposers import DraftModel, NGram, Proposal, Proposer, TreeProposal
from .sampling import SamplingConfig, probs_from_logits, sample
from .selfdraft import QuantizedSelf, quantize_in_memory
from .stats import SpecStats
from .tree import TokenTree, TreeSpec, grow_tree
from .verify import verify_greedy, verify_sampling, verify_tree_greedy, verify_tree_sampling

__all__ = [
    "AdaptiveK",
    "DraftModel",
    "FixedK",
    "NGram",
    "Proposal",
    "Proposer",
    "QuantizedSelf",
    "SamplingConfig",
    "SpecStats",
    "TokenTree",
    "TreeProposal",
    "TreeSpec",
    "check_same_vocab",
    "grow_tree",
    "make_proposer",
    "parse_scheme",
    "probs_from_logits",
    "quantize_in_memory",
    "sample",
    "speculative_generate",
    "verify_greedy",
    "verify_sampling",
    "verify_tree_greedy",
    "verify_tree_sampling",
]
