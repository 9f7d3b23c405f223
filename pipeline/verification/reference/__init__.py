"""Verify's reference: the target re-run through transformers, the yardstick for the captured hidden states.

- `model`: the transformers forward in vLLM's layer-id convention (and the final head's lm_head);
- `streamed`: the same forward streamed from the checkpoint a unit at a time under `verify.reference_memory_gib`,
  and the choice between it and the whole model;
- `cost`: what the reference costs in memory, whole or streamed, and the streamed reference's plan;
- `agreement`: closeness of a captured layer to a reference layer, layer identity, token shift (pure tensors);
- `check`: the reference check itself: seeded samples compared per layer, the final state's argmax.

They import, of verification, only the report (pipeline/verification/report.py: its findings).
"""
