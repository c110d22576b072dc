"""The executor service: holds weights and the paged KV cache, runs one batched forward
pass per StepPlan and samples. It never imports scheduler_svc."""
