"""Verify's per-sample tests: every sample scored and judged on its own.

- `scores`: per-token coherence of the captured layers with each other and with the token (the scan scores each
  shard's samples with it); `energy`: residual energies as shares of a state's; `exchange`: the exchange test's
  scores; `rounding`: fp8 rounding's expected energy in each residual;
- `positions`: where the tests look: each sample's judged positions, its seeded fold and half, the scoring batches;
- `next_token`: the next-token test: does a sample's final captured layer predict this sample's next tokens;
- `fit`: what the tests need before the scan: the input embedding and the predictors fitted on a seeded subset;
- `least_squares`, `whitening`: the cross-layer predictors' fit per fold; the whitened test's covariances;
- `calibration`: robust location and scale, whole-sample scores, thresholds fitted to the run's tail, and from how
  many scores each test runs;
- `judge`: every sample's scores judged against the run's.

They import, of verification, the reference model, the report (its findings), the shard view and the host staging
buffers; the scan and the per-shard checks above them use them.
"""
