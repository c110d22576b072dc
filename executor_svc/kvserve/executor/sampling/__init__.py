"""From logits to tokens: the batched sampler, penalties, seeded noise, structured-output masks,
and teacher-forced scoring."""
