"""Chunked linear + cross-entropy: the LM head and the loss without ever holding all logits.

    label_rows (host-built, on the device) --chunk of C rows--> hidden_CE = hidden[rows], targets[rows]
        --> logits_CV (fp32) --> CE sum = sum(logsumexp - z[target]), d_logits = softmax - onehot (in place)
        --> d_hidden[rows] = d_logits @ W, d_weight_VE += d_logits^T @ hidden_CE (both GEMMs in W's dtype,
            accumulated in fp32 across chunks)

Only tokens with a target are ever gathered: their rows come from the batch (RankBatch.label_rows, built on
the host with the batch), so no step of the loss asks the device which tokens have a target (no `.any()`,
`nonzero` or boolean mask, each a host sync on CUDA). Forward computes the gradients chunk by chunk right
away (as fused linear-CE kernels do), so peak memory is one chunk's fp32 logits [C, V] and one temporary
of that size plus the gradient buffers, never [T, V], and a chunk's buffers are freed before the next
chunk's exist (app/profiling/memory.py counts exactly that). Backward only scales the stored gradients
by the upstream gradient of the loss sum.
"""

from __future__ import annotations

import torch

from scheduling.payload import IGNORE_INDEX

LOSS_HEAD = "skrull_loss_head"
"""Attribute of a model built by workers/models.py that holds its LossHead."""


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_TE, weight_VE, bias_V, targets_T, label_rows, chunk):
        loss = torch.zeros((), dtype=torch.float32, device=hidden_TE.device)
        d_hidden = torch.zeros_like(hidden_TE)
        d_weight = torch.zeros(weight_VE.shape, dtype=torch.float32, device=weight_VE.device)
        d_bias = None if bias_V is None else torch.zeros(bias_V.shape, dtype=torch.float32,
                                                          device=bias_V.device)
        for start in range(0, label_rows.shape[0], chunk):
            # One call per chunk: its [C, V] tensors are freed on return, before the next chunk's exist.
            loss += _chunk_loss_and_grads(hidden_TE, weight_VE, bias_V, targets_T,
                                          label_rows[start:start + chunk], d_hidden, d_weight, d_bias)
        ctx.save_for_backward(d_hidden, d_weight, *(() if d_bias is None else (d_bias,)))
        ctx.has_bias = d_bias is not None
        ctx.param_dtype = weight_VE.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        d_hidden, d_weight, *rest = ctx.saved_tensors
        d_bias = (rest[0] * grad_loss).to(ctx.param_dtype) if ctx.has_bias else None
        return (d_hidden * grad_loss.to(d_hidden.dtype), (d_weight * grad_loss).to(ctx.param_dtype),
                d_bias, None, None, None)


def _chunk_loss_and_grads(hidden_TE: torch.Tensor, weight_VE: torch.Tensor, bias_V: torch.Tensor | None,
                          targets_T: torch.Tensor, rows: torch.Tensor, d_hidden: torch.Tensor,
                          d_weight: torch.Tensor, d_bias: torch.Tensor | None) -> torch.Tensor:
    """One chunk's CE sum over `rows`, its gradients written into d_hidden[rows] and added to d_weight /
    d_bias. CE = logsumexp(z) - z[target]; dCE/dz = softmax(z) - onehot, made in place in the fp32 logits
    (exp(z - logsumexp)), so the chunk holds one fp32 [C, V] buffer and its copy in the weights' dtype."""
    tgt = targets_T.index_select(0, rows)[:, None]
    h = hidden_TE.index_select(0, rows)
    logits = torch.nn.functional.linear(h, weight_VE, bias_V).float()
    lse = torch.logsumexp(logits, dim=-1)
    loss = (lse - logits.gather(1, tgt)[:, 0]).sum()
    d_logits = logits.sub_(lse[:, None]).exp_()  # softmax, in the logits' storage
    d_logits.scatter_(1, tgt, d_logits.gather(1, tgt) - 1.0)
    if d_bias is not None:
        d_bias += d_logits.sum(0)
    d_logits_lp = d_logits.to(weight_VE.dtype)
    del logits, d_logits  # the fp32 buffer (when the weights are not fp32 themselves) before the GEMMs
    d_hidden.index_copy_(0, rows, (d_logits_lp @ weight_VE).to(d_hidden.dtype))
    # In the weights' dtype: an fp32 [V, C] x [C, E] product runs on CUDA cores, not tensor cores
    # (26% of a 0.5B model's micro-batch on an H200, measured). The GEMM accumulates in fp32 and
    # rounds each chunk's sum once, as the model's own bf16 lm_head backward does; chunks add in fp32
    # (add_ upcasts elementwise: no fp32 copy of the product).
    d_weight.add_(d_logits_lp.T @ h)
    return loss


def linear_cross_entropy_sum(
    hidden_TE: torch.Tensor, head: torch.nn.Linear, targets_T: torch.Tensor, chunk_tokens: int = 4096,
    *, label_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 sum of CE(head(hidden[t]), targets[t]) over targets != -100, chunk_tokens label tokens at a time.

    `label_rows`: the rows with a target, ascending, on hidden's device (RankBatch.label_rows). Without it
    they are found here from `targets_T`, which reads the targets on the host: fine on CPU and in tools,
    a host sync on CUDA (the training step always passes them).
    """
    if chunk_tokens < 1:
        raise ValueError("train.loss_chunk_tokens must be >= 1")
    if label_rows is None:
        label_rows = torch.nonzero(targets_T != IGNORE_INDEX).flatten()
    return _ChunkedLinearCE.apply(hidden_TE, head.weight, head.bias, targets_T, label_rows, chunk_tokens)


class LossHead(torch.nn.Module):
    """`linear_cross_entropy_sum` over the model's output embedding, as a module of the model's own tree.

    The loss reads the LM head's weight outside the head's forward (it never builds all logits), which a
    ZeRO-3 engine cannot see: it gathers a partitioned weight in the pre-forward hook of a module that
    uses it. Called as a module attached to the model (workers/models.py `attach_loss_head`), with the head's
    parameters registered as its external parameters (workers/engine.py), the weight is gathered for the
    loss's forward and again for its backward, and released after each, on every ZeRO stage alike. The
    head is held outside the module tree (no second copy of its parameters in the state dict).
    """

    def __init__(self, head: torch.nn.Linear) -> None:
        super().__init__()
        self._head = (head,)  # a tuple: not registered as a child module
        self.linear_ce = linear_cross_entropy_sum
        """The kernel set's linear cross-entropy (workers/kernels): same arguments, same fp32 sum."""

    @property
    def head(self) -> torch.nn.Linear:
        return self._head[0]

    def forward(self, hidden_TE: torch.Tensor, targets_T: torch.Tensor, label_rows: torch.Tensor,
                chunk_tokens: int) -> torch.Tensor:
        return self.linear_ce(hidden_TE, self.head, targets_T, chunk_tokens, label_rows=label_rows)
