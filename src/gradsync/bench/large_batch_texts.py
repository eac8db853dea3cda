"""The words of ``bench large-batch``'s section in docs/benchmarks.md: what it measures, how to read it."""

from __future__ import annotations

LARGE_BATCH_ABOUT = {
    "large-batch": """\
How far the global batch can grow before accuracy falls (issue 40). One
model, MNIST-1D's MLP (40-100-100-10), is trained by `gradsync train
--nproc 2` for the same 60 epochs of the same 32768 training samples
(`--num-samples 40960`, 20% kept for the test) at global batch 128, 512,
2048, 4096 and 8192: every row sees the same samples, and a larger batch
takes fewer steps (steps = epochs x train samples // batch: 15360 at 128,
480 at 4096, 240 at 8192). The MLP, not the CNN, because at a batch of 128
both cost the same per step (the step is communication and Python, not
arithmetic) while at 4096 the MLP computes several times as fast, so
within the 30 minutes the 60 runs may take on this 2-core machine (when it
is otherwise idle) the MLP affords a budget several times the CNN's: the
largest batches get a few hundred steps instead of a few dozen.

Four recipes, each one setting for every batch, its lr given at the base
batch 128 and scaled by `gradsync train --lr-scaling` to the run's batch,
all with a cosine decay after the warm-up:
`sgd-linear` (SGD, momentum 0.9, weight decay 1e-4, lr scaled linearly, no
warm-up: Goyal et al. 2017's rule without their warm-up; at batch 128 it is
the baseline), `sgd-warmup` (the same with 5 epochs of linear warm-up,
Goyal et al.'s), `lars-warmup` (LARS, You et al. 2017: momentum 0.9, trust
coefficient 0.001, weight decay 5e-4, biases excluded; 5 epochs of warm-up)
and `lamb-warmup` (LAMB, You et al. 2019: betas 0.9 and 0.999, weight decay
0.01, biases excluded; 5 epochs of warm-up); LARS and LAMB scale their lr
by the square root of the batch ratio, as You et al. 2019 do. Each
recipe's base lr is the best of a grid (factors of 2 and 4) at batch 128,
one seed, this budget; the other settings are the papers'
(`RECIPES` in `src/gradsync/bench/large_batch.py`; the bench prints each
recipe's options first). Every (recipe, batch) trains once per seed
(`--seeds`), the runs of each seed in a rotated order.

`test acc %` is the final test accuracy, the median over the seeds with
its min–max; `vs base pp` the median against the baseline's, in percentage
points; `train loss` the last epoch's mean (median); `peak lr` the largest
lr a run stepped with; `wall s` and `samples/s` medians of the training
loop (its evaluations included); `runs` how many seeds ended. The goal
lines judge issue 40's goal at 4096 on the medians: the best of the other
recipes loses at most half of what `sgd-linear` loses there, and at most 2
pp. The lines for 8192 name, per recipe, the first batch more than 2 pp
below the baseline and the measured reason at 8192: diverged (final train
loss no better than a uniform guess over ten classes, or nan), unstable (an
epoch's train loss rose above 1.5 times a uniform guess's and came back
down), too few steps (train loss at least 1.5 times the recipe's own at
128; the line gives the steps and how much the test accuracy still rose
over the last quarter of the epochs), or a generalisation gap (train loss
close to it, test accuracy lower).""",
    "large-batch_after": """\
How to read it. Under a fixed sample budget a larger batch buys fewer, less
noisy steps. Linear scaling keeps the distance travelled per sample, but
the first steps at a large lr throw the weights where they do not recover
unless a warm-up lets the lr grow while they settle; LARS and LAMB set each
layer's step in proportion to its weights' norm, so no layer moves too far
at once. Both leave biases out of the trust ratio, as their papers do:
LAMB's biases still take Adam's normalised step, but LARS's take plain SGD
steps at the global lr, which the square-root rule takes to tens at the
largest batches, where SGD's own best at 128 is below one; run by hand
with the ratio on every parameter (`gradsync.optim.LARS(...,
exclude_1d=False)`), the same LARS stays stable there. Past some batch the steps themselves run out and every recipe
stops short of the baseline: the breaking lines say where, with the step
counts. The plot shows each recipe's median with its min–max over the
seeds.""",
}

LARGE_BATCH_TITLES = {"large-batch": "Large batches: linear scaling, warm-up, LARS and LAMB under one sample budget"}
