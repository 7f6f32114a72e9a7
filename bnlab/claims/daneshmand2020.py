"""Daneshmand, Kohler, Bach, Hofmann & Lucchi 2020, "Batch normalization provably avoids rank collapse for
randomly initialised deep networks" (NeurIPS): its claims and where bnlab checks them.

One ``Claim`` per theorem, lemma, proposition, corollary, definition with a checkable formula, figure
panel, algorithm and headline of the abstract/§1.2/§4 (see :mod:`bnlab.claims.core`).
"""
from __future__ import annotations

from bnlab.claims.core import Claim, Paper

__all__ = ["PAPER", "CLAIMS"]

PAPER = Paper("daneshmand2020", "Daneshmand et al. 2020 (NeurIPS), Batch normalization provably avoids rank collapse "
              "for randomly initialised deep networks", "Daneshmand et al. 2020")

_T = "tests/"
_DC = _T + "rank/test_daneshmand_claims.py::"

CLAIMS = [
    # ------------------------------------------------------------------ definitions and Lemma 1 (§2)
    Claim("daneshmand2020/eq2", "§2, Eq. 2", "BN_{0,1}(H) = diag(M(H))^{-1/2} H with M(H) = HHᵀ/N (no mean "
          "subtraction): every row of the output has unit second moment (App. A, p.1)", "formula",
          tests=[_T + "nets/test_norms.py::test_bn_nomean_is_daneshmand_eq2_matrix_form",
                 _T + "nets/test_norms.py::test_bn_nomean_train_and_eval_against_the_formula",
                 _T + "rank/test_chains.py::test_bn_chain_keeps_unit_row_norms"],
          strength="exact formula"),
    Claim("daneshmand2020/def1", "§2, Def. 1 and footnote 4", "standard initialization: i.i.d. zero-mean, "
          "unit-variance, symmetric weights (Gaussian, or uniform U[−√3, √3])", "formula",
          tests=[_T + "rank/test_chains.py::test_uniform_weights_have_unit_variance_and_support"],
          strength="exact formula"),
    Claim("daneshmand2020/eq3-4", "§2, Eqs. 3–4", "soft rank rank_τ(H) = #{i : σ_i²/N ≥ τ} and the bound "
          "r(H) = tr(M)²/‖M‖_F²", "formula",
          tests=[_T + "rank/test_measures.py::test_prescribed_singular_values_closed_forms",
                 _T + "rank/test_measures.py::test_stack_matches_per_matrix_loop_and_matrix_rank"],
          strength="exact formula"),
    Claim("daneshmand2020/lemma1a", "§2, Lemma 1 (first part)", "rank(H) ≥ r(H) for every matrix", "formula",
          tests=[_T + "rank/test_measures.py::test_lemma1_rank_bounds_r"], strength="exact formula"),
    Claim("daneshmand2020/lemma1b", "§2, Lemma 1 (second part)", "rank_τ(H_ℓ) ≥ (1−τ)² r(H_ℓ) along the BN chain "
          "(tr M = d), τ ∈ [0, 1]", "formula",
          tests=[_T + "rank/test_measures.py::test_lemma1_soft_rank_bound_at_unit_trace",
                 _T + "rank/test_measures.py::test_lemma1_part2_needs_the_unit_trace_premise",
                 _T + "rank/test_chains.py::test_lemma1_holds_along_bn_chains"],
          strength="exact formula",
          note="the bound needs tr M = d (true on the BN chain); tested to fail without that premise"),
    # ------------------------------------------------------------------ Theorem 2 and its figures (§3.1)
    Claim("daneshmand2020/thm2", "§3.1, Thm 2 (Eq. 5)", "the depth-averaged rank_τ of BN linear chains is "
          "Ω((1−τ)²√d) almost surely, for small γ and any τ ∈ [0, 1)", "formula",
          tests=[_T + "rank/test_chains.py::test_bn_keeps_rank_sqrt_width_while_vanilla_collapses",
                 _T + "rank/test_chains.py::test_bn_rank_at_depth_1e5_all_variants"],
          checks=["daneshmand2020-fig3a: γ = …: exponent of mean rank_1/2 vs d"], strength="simulation",
          note="an asymptotic lower bound checked by simulation: the fitted exponent's whole 95 % interval "
          "must lie at or above ½"),
    Claim("daneshmand2020/fig3a", "§3.1, Fig. 3a", "the depth-averaged rank_½ grows like √d for γ from 0.01 "
          "to ∞ (no skip connection) — the bound holds beyond the small γ of Thm 2", "figure",
          checks=["daneshmand2020-fig3a: γ = …: exponent of mean rank_1/2 vs d"], strength="small-scale stand-in",
          note="small scale: depth 2 000 (the paper: 10⁶), γ ∈ {0.1, ∞}, d ≤ 128"),
    Claim("daneshmand2020/thm14", "App. E, Thm 14 (Eq. 62)", "formal bound: lim (1/L)Σ rank_τ ≥ (1−τ)²√((1−α)d) "
          "with the regularity constant α of the invariant distribution", "formula",
          tests=[_DC + "test_lemma13_eq55_thm14_bounds_at_the_estimated_alpha"], strength="simulation",
          note="E r(H) ≥ √((1−α)d) at the ergodic α of one run (d = 32, γ = 1): 4.88 against 2.10"),
    Claim("daneshmand2020/fig3b", "§3.1, Fig. 3b", "given nearly collinear inputs, BN quickly amplifies the small "
          "singular values of H_ℓ and reduces the largest one", "figure",
          checks=["daneshmand2020-fig3b: BN: σ_1, σ_2 of H_0"], strength="small-scale stand-in"),
    Claim("daneshmand2020/fig3b-vanilla", "§3.1, Fig. 3b (the contrast of §3.2)", "without BN nearly collinear "
          "inputs stay collinear (no amplification)", "figure",
          checks=["daneshmand2020-fig3b: vanilla: σ_1, σ_2 of H_0"], strength="small-scale stand-in"),
    Claim("daneshmand2020/assumptions", "§3.1, 'Necessary assumptions'", "both a full-rank input and the standard "
          "(symmetric, zero-mean) initialization are needed for BN's robust rank", "headline",
          checks=["daneshmand2020-fig5: asymmetric init, rank of H_L at initialization"],
          tests=[_T + "reproductions/test_daneshmand2020_fig5.py::test_asymmetric_init_collapses_the_last_hidden_layer_at_init"],
          strength="simulation", note="the initialization half only; the full-rank-input half is not tested"),
    # ------------------------------------------------------------------ Lemma 3 (§3.2)
    Claim("daneshmand2020/lemma3a", "§3.2, Lemma 3a (Eq. 6)", "vanilla linear residual products B_ℓX/‖B_ℓ‖ with "
          "Gaussian weights converge to rank one for γ ∈ (0, 1)", "formula",
          tests=[_T + "rank/test_chains.py::test_lemma3_residual_vanilla_products_collapse"],
          checks=["daneshmand2020-lemma3: gaussian weights"], strength="simulation"),
    Claim("daneshmand2020/lemma3b", "§3.2, Lemma 3b and footnote 7", "with uniform U[−√3, √3] weights they "
          "converge to rank one along a subsequence — and, per footnote 7, along every ℓ", "formula",
          checks=["daneshmand2020-lemma3: uniform weights"], strength="simulation",
          note="measured along every ℓ (footnote 7's stronger statement)"),
    Claim("daneshmand2020/lyapunov", "§3.2 and footnote 6", "the gap between the top two singular values of the "
          "product grows exponentially (the Lyapunov exponents)", "formula",
          checks=["daneshmand2020-lemma3: gaussian weights"], strength="simulation",
          note="the rate 1/(2(d−1)) for γ = ∞ is compared in docs/rank.md, not judged by a row"),
    # ------------------------------------------------------------------ directional gradient vanishing
    Claim("daneshmand2020/prop19", "§3.2 and App. H, Prop. 19", "with a rank-one last hidden layer the normalized "
          "per-sample gradients of each output neuron are collinear (±) for any two inputs", "formula",
          tests=[_T + "rank/test_hooks_pretrain_alignment.py::test_rank_one_representation_aligns_every_neuron_gradient",
                 _T + "rank/test_hooks_pretrain_alignment.py::test_per_sample_gradients_match_autograd_with_train_mode_bn"],
          checks=["daneshmand2020-fig6: mean |cos| of last-layer per-sample gradients at the start"],
          strength="exact formula"),
    Claim("daneshmand2020/fig10", "App. H, Fig. 10", "a VGG-19 without BN on CIFAR-10 has perfectly aligned "
          "gradients through training and stays untrainable, also at 100× the learning rate", "figure",
          checks=["daneshmand2020-fig6: gradient alignment through training"], strength="small-scale stand-in",
          note="stand-in: depth-32 MLPs on Fashion-MNIST, one learning rate"),
    Claim("daneshmand2020/fig10-random", "App. H, Fig. 10 (left)", "on random uniform images SGD takes almost the "
          "same path as on CIFAR-10", "figure",
          not_checked="the random-data run is not reproduced (needs the VGG-19/CIFAR-10 setting and a GPU)"),
    # ------------------------------------------------------------------ Fig. 1, Fig. 2 (§1)
    Claim("daneshmand2020/fig1-rank", "§1.1, Fig. 1 (left)", "the rank of the last hidden layer of vanilla ReLU "
          "MLPs (width 128, PyTorch init) collapses with depth while BN keeps it high", "figure",
          checks=["daneshmand2020-fig1: rank of H_L at init"], strength="small-scale stand-in"),
    Claim("daneshmand2020/fig1-accuracy", "§1.1, Fig. 1 (right)", "vanilla MLPs barely learn beyond ~10 layers; BN "
          "MLPs' training accuracy drops only mildly up to depth 32", "figure",
          checks=["daneshmand2020-fig1: training accuracy at depth", "advise-validation: rank-vanilla",
                  "advise-validation: rank-bn"], strength="small-scale stand-in",
          note="small scale: 400 SGD steps (the paper: 75 epochs) and one learning rate"),
    Claim("daneshmand2020/fig2-bn", "§1.1, Fig. 2", "BN stabilizes the rank of linear and ReLU MLPs (d = 32) above "
          "√d at any depth", "figure",
          checks=["daneshmand2020-fig2: BN …: rank_1/2 of H_L"], strength="small-scale stand-in",
          note="depth 1 000 (the paper: 50 000)"),
    Claim("daneshmand2020/fig2-vanilla", "§1.1, Fig. 2", "the rank of vanilla linear and ReLU MLPs drops towards one "
          "with depth", "figure",
          checks=["daneshmand2020-fig2: vanilla …: rank_1/2 of H_L"], strength="small-scale stand-in"),
    # ------------------------------------------------------------------ App. C–E: the proof's steps
    Claim("daneshmand2020/lemma4", "App. C, Lemma 4", "under the unique invariant distribution each row H_i: has "
          "the same law as −H_i: (so E[M_ij] = 0 for i ≠ j)", "formula",
          tests=[_DC + "test_lemma4_sign_symmetry_off_diagonal_second_moment_is_zero"], strength="simulation",
          note="the consequence E M_ij = 0 is tested (ergodic mean within 4 standard errors), not the law itself"),
    Claim("daneshmand2020/centering", "§2 and App. C, Fig. 7", "leaving out BN's mean subtraction does not change "
          "its performance (VGG, CIFAR-10): accuracy and r(H_L) stay close", "figure",
          checks=["daneshmand2020-fig5: BN without mean subtraction, training accuracy",
                  "daneshmand2020-fig5: BN without mean subtraction, rank of H_L",
                  "daneshmand2020-fig6: BN without mean subtraction"], strength="small-scale stand-in"),
    Claim("daneshmand2020/lemma5", "App. D, Lemma 5", "for γ ≤ 1/(8d) and bounded weights the BN chain keeps "
          "rank(H_ℓ) ≥ 2 almost surely", "formula",
          not_checked="only its proof step Lemma 6 (rank one is absorbing) is tested; no test runs the chain at "
          "γ ≤ 1/(8d) from a rank ≥ 2 start"),
    Claim("daneshmand2020/lemma6", "App. D, Lemma 6", "once rank(H_k) = 1, M(H_ℓ) = M(H_k) for every ℓ > k with "
          "entries ±1", "formula",
          tests=[_DC + "test_lemma6_rank_one_representation_keeps_its_second_moment_for_small_gamma"],
          strength="exact formula"),
    Claim("daneshmand2020/lemma7", "App. E, Lemma 7 (Eq. 43)", "(E_W‖M₊‖_F² − ‖M‖_F²)/γ² = δ_F(M) + O(γ), "
          "δ_F = 2d² − 2‖M‖_F² − 8 tr M³ + 8 tr diag(M²)²", "formula",
          tests=[_DC + "test_lemma7_drift_is_half_the_laplacian_of_the_one_layer_map",
                 _DC + "test_lemma7_monte_carlo_remainder_is_higher_order_in_gamma"], strength="exact formula"),
    Claim("daneshmand2020/prop8", "App. E, Prop. 8 (Eqs. 44–45)", "with rows of equal norm: tr M³ = ‖λ‖₃³, "
          "tr diag(M²)² = ‖λ‖⁴/d, ‖M‖_F² = ‖λ‖₂², so δ_F is a function of the spectrum", "formula",
          tests=[_DC + "test_prop8_equal_row_norms_spectral_forms",
                 _DC + "test_regularity_terms_equal_their_eigenvalue_forms"], strength="exact formula"),
    Claim("daneshmand2020/example9", "App. E, Example 9", "from λ₁ = d − γ²(d−1), λ_i = γ², one step lowers "
          "E‖M₊‖_F² by at least γ⁴d² (the small eigenvalues grow)", "formula",
          tests=[_DC + "test_example9_one_layer_shrinks_the_spike_and_lifts_the_small_eigenvalues"],
          strength="simulation",
          note="the direction is tested (δ_F < 0; E λ₁ falls, E λ₂ rises, Monte Carlo); the size γ⁴d² of the drop "
          "is not asserted"),
    Claim("daneshmand2020/lemma10", "App. E, Def. 3, Lemma 10", "the regularity constant α = E tr diag(M²)² / "
          "E tr M³ of the invariant distribution is below one for small γ", "formula",
          checks=["daneshmand2020-fig89: α below 0.9 for d > 10"],
          tests=[_DC + "test_fig8_regularity_constant_below_0_9_for_d_above_10"], strength="simulation",
          note="α estimated by ergodic averages (Eq. 49) at γ = 1 and 0.1, not at the lemma's vanishing γ"),
    Claim("daneshmand2020/fig8", "App. E, Fig. 8", "the estimated α is below 0.9 for d > 10 and decreases with d "
          "(γ = 1 and 0.1, L = 10⁵)", "figure",
          checks=["daneshmand2020-fig89: α below 0.9 for d > 10", "daneshmand2020-fig89: α decreases with d"],
          tests=[_DC + "test_fig8_regularity_constant_below_0_9_for_d_above_10"], strength="small-scale stand-in", note="2 000 layers (the paper: 10⁵), d ≤ 64"),
    Claim("daneshmand2020/example11", "App. E, Example 11", "if every M(H) in the support has rows of equal "
          "norm and α ≥ 1, all non-zero eigenvalues of M(H) are equal", "formula",
          tests=[_DC + "test_regularity_constant_is_one_when_all_nonzero_eigenvalues_are_equal"],
          strength="exact formula", note="only the converse is tested: a point mass on an M with equal non-zero eigenvalues has α = 1 "
          "exactly; that α ≥ 1 forces equal eigenvalues is not"),
    Claim("daneshmand2020/example12", "App. E, Example 12", "with equal row norms, λ₁ = Θ(d^β) and the other "
          "eigenvalues o(d^β), β < 1, the regularity constant is below 0.9 for large d", "formula",
          not_checked="no test builds such a spectrum family; the α of the BN chain itself is tested "
          "(daneshmand2020/fig8)"),
    Claim("daneshmand2020/lemma13", "App. E, Lemma 13 (Eq. 50)", "E‖M(H)‖_F² ≤ d^{3/2}/√(1−α) under the "
          "invariant distribution, for small γ", "formula",
          checks=["daneshmand2020-fig89: Lemma 13 bound"],
          tests=[_DC + "test_lemma13_eq55_thm14_bounds_at_the_estimated_alpha"], strength="simulation",
          note="checked at the ergodic α of the same run, γ = 1 and 0.1"),
    Claim("daneshmand2020/fig9", "App. E, Fig. 9", "log₂ of the depth-averaged ‖M‖_F² grows like log₂ d^{1.5} "
          "(γ = 1 and 0.1, L = 10⁵)", "figure",
          checks=["daneshmand2020-fig89: exponent of E‖M‖²_F in d"],
          tests=[_DC + "test_fig9_frobenius_norm_grows_at_most_like_d_to_the_three_halves"],
          strength="small-scale stand-in",
          note="2 000 layers (the paper: 10⁵), d ≤ 64"),
    Claim("daneshmand2020/cor15", "App. E, Cor. 15", "rank(H_ℓ) = Ω(√d) at every finite ℓ (and rank_τ, if the "
          "sequence is non-increasing)", "formula",
          tests=[_DC + "test_cor15_rank_bound_holds_at_every_layer_not_only_on_average"], strength="simulation",
          note="the minimum over 2 000 layers of one chain (d = 16, 32); Ω(√d) read as ≥ √d"),
    Claim("daneshmand2020/lemma16", "App. E, Lemma 16", "a non-increasing bounded integer sequence whose running "
          "mean exceeds α is ≥ α everywhere", "formula",
          not_checked="a fact about integer sequences with nothing to compute; bnlab has no code it bears on"),
    Claim("daneshmand2020/widths", "App. E, remark on the number of hidden units", "the result extends to nets with "
          "blocks of equal widths (VGG, ResNet)", "headline",
          not_checked="no varying-width chain is simulated"),
    # ------------------------------------------------------------------ §4: the rank's role in training
    Claim("daneshmand2020/alg1", "App. G, Algorithm 1", "layer-wise gradient ascent on r(H_ℓ) (a few steps per "
          "layer) raises the rank of the last hidden layer", "algorithm",
          tests=[_T + "rank/test_hooks_pretrain_alignment.py::test_pretraining_objective_is_the_rank_bound_of_the_named_layer",
                 _T + "rank/test_hooks_pretrain_alignment.py::test_pretraining_raises_the_last_layer_rank_5x",
                 _T + "rank/test_hooks_pretrain_alignment.py::test_pretraining_paper_width_128"],
          checks=["daneshmand2020-fig6: pretrain"], strength="simulation"),
    Claim("daneshmand2020/fig4", "§4, Fig. 4 (CIFAR-10) and Fig. 12 (Fashion-MNIST)", "the slow-down of SGD with "
          "depth is much milder for rank-pre-trained vanilla MLPs than for vanilla ones", "figure",
          checks=["daneshmand2020-fig4: depth …: final training loss, pre-trained vs vanilla",
                  "daneshmand2020-fig4: slow-down with depth",
                  "daneshmand2020-pretrain-lr: pre-trained beats vanilla at depth 32"], strength="small-scale stand-in",
          note="Fashion-MNIST (Fig. 12), 500 SGD steps at one learning rate (the paper grid-searches it)"),
    Claim("daneshmand2020/pretrain-beats-bn", "§1.2, §4 'Outperforming BN', Fig. 4", "rank pre-training lets vanilla "
          "SGD outperform BN on very deep MLPs (it is faster than BN on deep networks)", "headline",
          checks=["daneshmand2020-fig4: deepest depth: pre-trained vs BN",
                  "daneshmand2020-pretrain-lr: pre-trained beats BN at depth 32"], strength="small-scale stand-in",
          note="daneshmand2020-fig4 runs one step size; daneshmand2020-pretrain-lr searches it as the paper does "
          "(500 steps, one seed): the pre-trained net beats BN at a shared small step, BN wins with each at its "
          "best step (docs/rank.md)"),
    Claim("daneshmand2020/fig11", "App. I, Fig. 11", "on CIFAR-10 the pre-trained nets' advantage shows in training "
          "accuracy and test loss too", "figure",
          not_checked="needs CIFAR-10 (not available offline) and the paper's long training"),
    Claim("daneshmand2020/fig6-accuracy", "§4, Fig. 6 (left)", "depth-32 vanilla MLPs pre-trained with 25 and 75 "
          "steps per layer train (more steps: faster), the plain vanilla net does not", "figure",
          checks=["daneshmand2020-fig6: pretrain", "daneshmand2020-pretrain-lr: pre-trained beats vanilla at depth 32"],
          strength="small-scale stand-in"),
    Claim("daneshmand2020/fig6-bn", "§4, Fig. 6 (dashed) and Fig. 1", "BN nets train at depth 32 where vanilla nets "
          "do not", "figure",
          checks=["daneshmand2020-fig6: BN: training accuracy"], strength="small-scale stand-in"),
    Claim("daneshmand2020/rank-preserved", "§1.2, §4 'Rank through the optimization', Fig. 6 (right)", "SGD "
          "preserves the order of magnitude of the initial rank throughout optimization, for every network "
          "type", "headline",
          checks=["daneshmand2020-fig6: rank through training", "daneshmand2020-pretrain-lr: r(H_L) preserved by SGD"],
          strength="small-scale stand-in",
          note="500 SGD steps; the paper trains for many epochs.  The rank that pre-training creates is not "
          "preserved (×0.33–0.38 at every step size that trains), BN's and the collapsed vanilla net's are "
          "(docs/rank.md)"),
    Claim("daneshmand2020/fig5-rank", "§4 'Breaking BN', Fig. 5 (right)", "the asymmetric initialization "
          "U[0, 2/√d] collapses the rank of BN nets' last hidden layer (VGG-19, CIFAR-10)", "figure",
          checks=["daneshmand2020-fig5: asymmetric init, rank of H_L at initialization",
                  "daneshmand2020-fig5: asymmetric init, rank of H_L after"],
          tests=[_T + "reproductions/test_daneshmand2020_fig5.py::test_the_papers_full_width_nets_collapse_under_the_asymmetric_init"],
          strength="small-scale stand-in", note="small scale: VGG-11 at 1/8 width on MNIST; the full-width VGG-19 "
          "collapse at initialization is tested"),
    Claim("daneshmand2020/fig5-accuracy", "§4 'Breaking BN', Fig. 5 (left)", "with the asymmetric initialization "
          "VGG-19 with BN cannot fit CIFAR-10", "figure",
          checks=["daneshmand2020-fig5: asymmetric init, training accuracy"], strength="small-scale stand-in"),
    Claim("daneshmand2020/breaking-mlp", "§4 'Breaking BN', Fig. 6 (dashed)", "the asymmetric initialization lowers "
          "the rank of BN MLPs and slows their training markedly", "figure",
          checks=["daneshmand2020-fig6: breaking BN"], strength="small-scale stand-in"),
    Claim("daneshmand2020/fig13", "App. I, Fig. 13", "ResNet-50 with BN cannot fit CIFAR-10 under the asymmetric "
          "initialization either (and BN without centering trains like BN)", "figure",
          tests=[_T + "reproductions/test_daneshmand2020_fig5.py::test_the_papers_full_width_nets_collapse_under_the_asymmetric_init"],
          strength="simulation",
          note="only the rank collapse of the full-width ResNet-50 at initialization is tested; its training is "
          "declared at paper scale (CIFAR-10 and a GPU)"),
    Claim("daneshmand2020/abstract", "Abstract, §1.2 (ii)", "rank and training accuracy of nets without BN "
          "diminish quickly with depth, in MLPs and conv nets; BN keeps both", "headline",
          checks=["daneshmand2020-fig1: rank of H_L at init", "daneshmand2020-fig1: training accuracy at depth"],
          strength="small-scale stand-in"),
]
