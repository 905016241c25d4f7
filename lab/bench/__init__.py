"""harken's lab, out of the product: every `harken bench ...` command, the fuzzer's targets and
inputs, the official streaming algorithm re-implemented as the baseline ("Phase 1"), the Opus
reference codec and the word-latency measures. Product modules (edge/, shared/, cloud/) never
import from here; this package imports from all of them."""
