"""Generated result documents (docs/*.md and their figures), each from model cards or runs, never typed:

zoo.py        docs/results.md   the default zoo (perplexity, PRR, PEoP)      python -m analysis.reports.zoo
pruning.py    docs/pruning.md   perplexity vs sparsity by context size       python -m analysis.reports.pruning
adapters.py   docs/adapters.md  full fine-tune vs adapter kinds, with pruning python -m analysis.reports.adapters
"""
