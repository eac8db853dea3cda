"""The words of ``bench large-batch``'s section in docs/benchmarks.md: what it measures, how to read it."""

from __future__ import annotations

LARGE_BATCH_ABOUT = {
    "large-batch": """\
How far the global batch can grow (issue 40): one model, MNIST-1D's MLP
(40-100-100-10), trained by `gradsync train --nproc 2` for the same epochs
of the same train split at global batch 128, 512, 2048, 4096 and 8192, so
every row sees the same samples and the larger batches take fewer steps
(steps = epochs x train samples // batch). Four recipes, each one setting
for every batch, its lr given at the base batch 128 and scaled by `gradsync
train --lr-scaling`: `sgd-linear` (SGD with momentum 0.9, lr scaled
linearly, no warm-up: Goyal et al. 2017 without their warm-up, the
baseline), `sgd-warmup` (the same with a linear warm-up, Goyal et al.),
`lars-warmup` (LARS, You et al. 2017) and `lamb-warmup` (LAMB, You et al.
2019, lr scaled by the square root of the batch ratio as that paper does);
all decay with a cosine after the warm-up. The command lines each recipe
adds are printed at the top of the bench's output and in
`src/gradsync/bench/large_batch.py` (`RECIPES`), with how each setting was
chosen. Every (recipe, batch) trains once per seed, the runs of each seed
in a rotated order. `test acc %` is the final test accuracy, the median
over the seeds with its min–max; `vs base pp` the median against the
baseline (`sgd-linear` at 128), in percentage points; `train loss` the last
epoch's mean (median); `peak lr` the largest lr a run stepped with; `wall
s` and `samples/s` medians of the training loop (evaluations included).
The goal lines judge issue 40's goal at 4096 on the medians; the lines for
8192 say, per recipe, the first batch more than 2 pp below the baseline and
the measured reason at 8192: diverged (train loss no better than a uniform
guess, or nan), too few steps (train loss at least 1.5 times the recipe's
own at 128), or a generalisation gap (train loss close to it, test
accuracy lower).""",
    "large-batch_after": """\
How to read it. Under a fixed sample budget a larger batch buys fewer, less
noisy steps: linear scaling keeps the distance travelled per sample, and
without a warm-up its early steps at a large lr can throw the model where
it does not recover; a warm-up lets the lr grow while the weights settle;
LARS and LAMB set each layer's step in proportion to its weights' norm, so
no layer moves too far at once. Past some batch the steps themselves run
out: every recipe then stops short of the baseline, which the breaking
lines name with the step counts. The plot shows each recipe's median with
its min–max over the seeds.""",
}

LARGE_BATCH_TITLES = {"large-batch": "Large batches: linear scaling, warm-up, LARS and LAMB under one sample budget"}
