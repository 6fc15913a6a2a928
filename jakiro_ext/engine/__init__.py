"""The draft-verify loop: the entry points (``generate``), a batch of sequences and its round
(``batch``), one sequence in flight (``sequence``), tree drafting (``drafter``), CUDA-graph
replay (``graphs``) and what a graphed call keeps for the next (``graph_sessions``), the tree
cost model (``tree_cost``) and a host-read counter for tests and benchmarks (``host_reads``)."""
from jakiro_ext.config import CPU_TREE, GPU_TREE, MAX_BATCH, TreeConfig
from jakiro_ext.engine.generate import generate_many, speculative_generate
from jakiro_ext.engine.graph_sessions import free_graphs
from jakiro_ext.engine.policy import default_tree
from jakiro_ext.engine.sequence import GenerationOutput, GenerationStats

__all__ = ["CPU_TREE", "GPU_TREE", "MAX_BATCH", "GenerationOutput", "GenerationStats", "TreeConfig", "default_tree",
           "free_graphs", "generate_many", "speculative_generate"]
