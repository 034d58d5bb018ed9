"""Adaptively sparse attention / dynamic context pruning (docs/context_pruning.md), the model's side of it:

interaction.py     ContextPruning: W^Qint, W^Kint, beta (and the distance term's lambda) and the calls that give
                   x_{n,j}, I and log I, the survival rule and the sparsity loss; their pure maths, which the kernels
                   share, are kernels/keep_rule.py, and the alpha-sigmoid with its schedule kernels/alpha_sigmoid.py
patterns.py        the fixed local / strided baselines
compact_cache.py   the compacted cache of one layer: what it holds live, what dropped what, the decode step's writes
slots.py           its storage: free-slot insert, append, doubling, compaction into new tensors
fixed_compact.py   the compacted cache with fixed shapes (device-side cursors, compaction in place: CUDA graphs)
policies.py        the training-free eviction policies, each a step and a prompt compression
eviction.py        the one engine that drives a policy, for the decode step and for replay.py (a whole text)
intervene.py       the rule with forced decisions
imitation.py       train.imitate: the rule fitted to a keep target from cached inputs of the dense model
"""
from models.pruning.interaction import (ContextPruning, drop_records, mean_sparsity, pair_count, sparsity,
                                        sparsity_loss)
from models.pruning.patterns import PATTERNS, pattern_allows, pattern_mask

__all__ = ["ContextPruning", "drop_records", "mean_sparsity", "pair_count", "sparsity", "sparsity_loss", "PATTERNS",
           "pattern_allows", "pattern_mask"]
