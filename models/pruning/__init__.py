"""Adaptively sparse attention / dynamic context pruning (docs/context_pruning.md), the model's side of it:

interaction.py     ContextPruning: W^Qint, W^Kint, beta (and the distance term's lambda) and the calls that give
                   x_{n,j}, I and log I, the survival rule and the sparsity loss; their pure maths, which the kernels
                   share, are kernels/keep_rule.py, and the alpha-sigmoid with its schedule kernels/alpha_sigmoid.py
patterns.py        the fixed local / strided baselines
compact_cache.py   the inference data structure (free-slot insert, delete by mask, compaction, doubling)
policies.py        the training-free eviction policies; replay.py runs one over a whole text
intervene.py       the rule with forced decisions
"""
from kernels.alpha_sigmoid import alpha_schedule, alpha_sigmoid
from models.pruning.interaction import (ContextPruning, drop_records, mean_sparsity, pair_count, sparsity,
                                        sparsity_loss, survives)
from models.pruning.patterns import PATTERNS, pattern_allows, pattern_mask

__all__ = ["alpha_schedule", "alpha_sigmoid", "ContextPruning", "drop_records", "mean_sparsity", "pair_count",
           "sparsity", "sparsity_loss", "survives", "PATTERNS", "pattern_allows", "pattern_mask"]
