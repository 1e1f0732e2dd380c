"""Reference models for preference objectives, one file per strategy: the frozen base (`frozen_base`), a named
checkpoint (`checkpoint`), an EMA of the policy (`ema`), or a pool of the policy's own previous checkpoints (`pool`,
SePPO's "random checkpoint replay"); what they share is in `adapter`, DGPO's rollout policy θ⁻ in `old_policy`.

Every strategy has the same small API, used by the training loop and by any objective:

```python
reference = PoolReference(save_every=30, keep=7, selection="uniform")  # diffalign.reference.pool
reference.setup(policy)                        # once, before the optimizer is built
for step in range(max_steps):
    reference.on_step(policy, step)             # snapshot / re-draw θ_r when due
    with torch.no_grad(), reference.use(policy):
        ref_pred = policy.predict(...)          # runs θ_r
    ...
state = reference.state_dict()                  # saved with every training checkpoint, restored on resume
```

Apart from the frozen base (the LoRA adapter disabled), the reference weights live in a second peft LoRA adapter on the
policy's UNet, named ``"reference"`` (`ReferenceAdapter`): its tensors are the policy adapter's shape, own their storage,
never require grad, and are made active only inside ``use(policy)``, which also puts the UNet in eval mode. The pool
stores LoRA state dicts (cloned tensors), never model copies, so K stored references cost K × (adapter bytes) plus the
one reference adapter; a full-UNet fine-tune (``model.lora_rank=null``) is rejected at `setup`.

Each strategy also carries a `SampleCache` (``reference.samples``): samples that objectives such as SePPO generate with
the reference, valid while the reference does not change (one *selection stage*); it is emptied at every change and
saved with the checkpoints. ``reference.version`` counts the changes.
"""
