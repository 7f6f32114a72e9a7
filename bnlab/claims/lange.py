"""Lange, Helfrich & Ye, "Batch Normalization Preconditioning for Neural Network Training" (JMLR): its claims
and where bnlab checks them (see :mod:`bnlab.claims.core`)."""
from __future__ import annotations

from bnlab.claims.core import Claim, Paper

__all__ = ["PAPER", "CLAIMS"]

PAPER = Paper("lange", "Lange, Helfrich & Ye, Batch Normalization Preconditioning for Neural Network Training "
              "(JMLR)", "Lange et al.")

_T = "tests/"
_LC = _T + "optim/test_lange_claims.py::"
_CIFAR = "needs CIFAR-10, which is not available offline"

CLAIMS = [
    # ------------------------------------------------------------------ §2 background the method builds on
    Claim("lange/alg1", "§2, Algorithm 1 and Eq. 2", "batch normalization: centre and scale by the mini-batch mean "
          "and variance (+ε), then re-scale by γ and re-shift by β", "algorithm",
          tests=[_T + "nets/test_models.py::test_forward_matches_torch_batchnorm1d_layer_by_layer",
                 _T + "nets/test_norms.py::test_one_ghost_batch_is_torch_batchnorm"], strength="exact formula"),
    Claim("lange/eq3", "§2, Eq. 3", "Batch Renorm: γ((h−μ_H)/σ_H·s + d) + β with s = σ_H/σ, d = (μ_H−μ)/σ "
          "(no gradient through s, d) equals the inference formula γ(h−μ)/σ + β", "formula",
          tests=[_T + "nets/test_norms.py::test_brn_unclipped_training_output_equals_inference_with_the_old_running_stats",
                 _T + "nets/test_norms.py::test_brn_r_and_d_carry_no_gradient",
                 _T + "nets/test_norms.py::test_brn_train_and_eval_against_algorithm_1_with_clipping"],
          strength="exact formula"),
    # ------------------------------------------------------------------ §3.1–3.2 convergence theory
    Claim("lange/eq5-6", "§3.1, Eqs. 5–6", "gradient descent near a strongly convex minimum converges at the rate "
          "r = max|1−αλ|, optimal (κ−1)/(κ+1) at α = 2/(λ_min+λ_max)", "formula",
          tests=[_LC + "test_eq6_optimal_step_gives_rate_kappa_minus_one_over_kappa_plus_one"],
          strength="exact formula", note="a textbook result (Polyak 1964), tested on a κ = 50 quadratic"),
    Claim("lange/eq7-8", "§3.1, Eqs. 7–8", "gradient descent in z with θ = Pz is θ ← θ − αPPᵀ∇_θL: the "
          "preconditioned Hessian is Pᵀ∇²L P", "formula",
          tests=[_T + "optim/test_bnp_dense.py::test_functional_core_equals_dense_eq15",
                 _T + "optim/test_bnp_dense.py::test_functional_core_is_a_descent_direction"],
          strength="exact formula", note="tested through BNP's P of Eq. 15"),
    Claim("lange/thm1-null", "§3.2, Thm 1 (first part)", "on a positively scale-invariant manifold of minimizers "
          "the Hessian's null space contains Col(D_tθ*(t))", "formula",
          tests=[_LC + "test_theorem1_null_space_and_convergence_rate_on_the_scale_invariant_manifold"],
          strength="exact formula"),
    Claim("lange/thm1-rate", "§3.2, Thm 1 (second part)", "the distance to the closest minimizer contracts at "
          "r = max{|1−αλ*_min|, |1−αλ_max|} with λ*_min the smallest nonzero Hessian eigenvalue", "formula",
          tests=[_LC + "test_theorem1_null_space_and_convergence_rate_on_the_scale_invariant_manifold"],
          strength="exact formula", note="on a 3-input, 2-unit ReLU network fitted to its teacher"),
    # ------------------------------------------------------------------ §3.3 the preconditioner
    Claim("lange/prop2", "§3.3, Prop. 2 (Eqs. 10–11)", "the Hessian of the mini-batch loss w.r.t. one neuron's "
          "[b, w] is ĤᵀSĤ with Ĥ = [e, H], S = diag(L″)/N", "formula",
          tests=[_T + "optim/test_conditioning.py::test_neuron_hessian_equals_dense_autograd_hessian"],
          strength="exact formula"),
    Claim("lange/prop11", "§3.3 and App. A, Prop. 11", "κ(ĤᵀSĤ) ≤ κ(Ĥ)²κ(S)", "formula",
          tests=[_LC + "test_prop11_kappa_of_hts_h_at_most_kappa_h_squared_times_kappa_s"], strength="exact formula"),
    Claim("lange/thm3", "§3.3, Thm 3 (Eqs. 12–14)", "with P = UD (centre, then scale by 1/σ_H) the preconditioned "
          "Hessian is ĜᵀSĜ, Ĝ = [e, (H − eμᵀ)/σ]", "formula",
          tests=[_T + "optim/test_conditioning.py::test_preconditioned_hessian_is_theorem3_matrix"],
          strength="exact formula"),
    Claim("lange/thm4-centering", "§3.3, Thm 4 (first inequality)", "κ(ĤU) ≤ κ(Ĥ): centering never worsens the "
          "conditioning", "formula",
          tests=[_T + "optim/test_conditioning.py::test_theorem4_inequalities"], strength="exact formula"),
    Claim("lange/thm4-strict", "§3.3, Thm 4 (strictness)", "the first inequality is strict when μ_H ≠ 0 is not "
          "orthogonal to the principal component x_max", "formula",
          tests=[_LC + "test_theorem4_strictness_needs_mu_not_orthogonal_to_the_principal_component"],
          strength="exact formula"),
    Claim("lange/thm4-scaling", "§3.3, Thm 4 (second inequality)", "κ(Ĝ) ≤ √(n+1)·min over diagonal D₀ of "
          "κ(ĤUD₀)", "formula",
          tests=[_T + "optim/test_conditioning.py::test_theorem4_inequalities",
                 _LC + "test_theorem4_bound_against_the_best_diagonal_scaling_found",
                 _LC + "test_theorem4_equilibration_is_the_minimum_over_d0_when_property_a_holds"],
          strength="exact formula",
          note="the minimum over D₀ is approached by multi-start Nelder–Mead (exact where Property A holds); "
          "κ(Ĝ) is 1.02–1.14× the best D₀ found at n = 6, so D is not optimal in general"),
    Claim("lange/thm4-kappa-d", "§3.3 after Thm 4", "κ(ĤU) ≤ κ(Ĝ)κ(D): the preconditioning can improve the "
          "Hessian block's κ by about κ(D)²", "formula",
          tests=[_T + "optim/test_conditioning.py::test_theorem4_inequalities"],
          checks=["lange-fig8: κ(Ĥ) / κ(Ĝ)"], strength="exact formula"),
    Claim("lange/prop5", "§3.3, Prop. 5", "for iid zero-mean unit-variance entries, E‖(1/q)[e, G]‖ ≤ C√N with "
          "q² = max(n/N, 1), C independent of n", "formula",
          tests=[_LC + "test_prop5_scaled_normalized_matrix_norm_is_bounded_independently_of_the_width"],
          strength="simulation"),
    Claim("lange/alg2", "§3.3, Algorithm 2 (Eq. 15)", "one BNP step: running μ, σ² (ρ = 0.99), σ̃² = σ² + "
          "ε₁max σ² + ε₂, then G_w ← (G_w − μG_b)/(q²σ̃²), G_b ← G_b/q² − Σ G_w μ", "algorithm",
          tests=[_T + "optim/test_bnp_dense.py::test_algorithm2_three_steps_against_dense_reference",
                 _T + "optim/test_bnp_dense.py::test_regularized_variance_formula",
                 _T + "optim/test_bnp_native.py::test_native_matches_eager_bnp"],
          strength="exact formula"),
    Claim("lange/prop6", "§3.3, Prop. 6", "one BNP step costs 4n_{ℓ−1}N + 6n_{ℓ−1}n_ℓ + 2n_ℓ + 8n_{ℓ−1} "
          "floating point operations", "formula",
          tests=[_T + "optim/test_bnp_flops.py::test_leading_terms_match_prop6",
                 _T + "optim/test_bnp_flops.py::test_bnp_step_operation_count"],
          strength="exact formula", note="bnlab's step needs 5n_{ℓ−1}+2 per output neuron, below Prop. 6's 6n+2"),
    Claim("lange/bn-cost", "§3.3 after Prop. 6", "BN costs 32n_{ℓ−1}N + 4n_{ℓ−1} per layer, so BNP is cheaper "
          "when 28N > 6n_ℓ", "formula",
          tests=[_LC + "test_prop6_bn_cost_and_the_28n_vs_6n_crossover"], strength="exact formula",
          note="symbolic count; the paper's own batch-6 and batch-1 FC runs are on BN's side of the crossover"),
    Claim("lange/batch1-fc", "§3.3 after Alg. 2 and §4 (online learning)", "at N = 1 the fully connected Ĥ has one "
          "row (κ = 1): BNP can only balance the Hessian blocks' norms there", "formula",
          tests=[_LC + "test_section4_n1_fc_cannot_be_improved_but_a_convolution_can"], strength="exact formula"),
    # ------------------------------------------------------------------ §3.4–3.5 relation to BN, LN, GN
    Claim("lange/prop7", "§3.4, Prop. 7", "one gradient step of a post-activation BN network (no gradient through "
          "μ_H, σ_H) equals one BNP step on the equivalent vanilla network", "formula",
          tests=[_T + "optim/test_bnp_dense.py::test_proposition7_bn_step_equals_bnp_step",
                 _T + "optim/test_bnp_dense.py::test_proposition7_fails_with_running_statistics"],
          strength="exact formula"),
    Claim("lange/sec34-overparam", "§3.4", "a post-activation BN layer is an over-parametrized B_{0,1}: "
          "W·B_{β,γ}(h) + b = Ŵ·B_{0,1}(h) + b̂ with Ŵ = W diag(γ), b̂ = Wβ + b", "formula",
          tests=[_LC + "test_section34_post_activation_bn_is_an_overparametrized_b01"], strength="exact formula"),
    Claim("lange/gn-ln", "§3.5", "GroupNorm with one group is LayerNorm", "formula",
          tests=[_T + "nets/test_norms.py::test_layer_norm_and_group_norm_against_the_formula"],
          strength="exact formula"),
    # ------------------------------------------------------------------ §4 CNNs
    Claim("lange/lemma8", "§4, Lemma 8 (Eqs. 16–18)", "a convolution is â = ℋ̂ŵ with the unfolded matrix "
          "ℋ̂ = [e, ℋ] of kernel-entry columns", "formula",
          tests=[_T + "optim/test_bnp_conv.py::test_algorithm3_against_dense_unfold"], strength="exact formula"),
    Claim("lange/prop9", "§4, Prop. 9", "the conv layer's Hessian w.r.t. one output channel's kernel and bias is "
          "ℋ̂ᵀSℋ̂", "formula",
          not_checked="the FC form (Prop. 2) is tested against a dense autograd Hessian; the conv layer's is not"),
    Claim("lange/prop10", "§4, Prop. 10 (Eqs. 19–22)", "the per-kernel-entry means of ℋ differ from the channel "
          "mean by at most (k−1)(1/2r + 1/2s − (k−1)/4rs)·max|h|", "formula",
          tests=[_T + "optim/test_bnp_conv.py::test_unfold_and_channel_statistics_differ_by_the_border"],
          strength="exact formula"),
    Claim("lange/alg3", "§4, Algorithm 3", "BNP for a conv layer: per-channel statistics over batch and space, "
          "q² = max(c k²/N, √(rs))", "algorithm",
          tests=[_T + "optim/test_bnp_conv.py::test_algorithm3_against_dense_unfold",
                 _T + "optim/test_bnp_conv.py::test_channels_last_gradients"], strength="exact formula"),
    Claim("lange/cnn-statistics", "§4 closing remark, §1", "the derivation justifies normalizing conv layers by the "
          "mean and variance over the mini-batch and both spatial dimensions", "headline",
          tests=[_T + "optim/test_bnp_conv.py::test_unfold_and_channel_statistics_differ_by_the_border"],
          strength="exact formula"),
    Claim("lange/batch1-cnn", "§4 closing remark", "for CNNs, ℋ̂ has Nrs rows, so BNP still improves "
          "conditioning at N = 1", "formula",
          tests=[_LC + "test_section4_n1_fc_cannot_be_improved_but_a_convolution_can"], strength="exact formula",
          note="one 3-channel 8 × 8 input: κ 270 → 8.6"),
    # ------------------------------------------------------------------ §5 experiments
    Claim("lange/fig3-mnist", "§5, Fig. 3 (left)", "FC 3×100 at mini-batch 60 on MNIST: BN and BNP comparable, both "
          "above the vanilla network (and LN)", "figure",
          checks=["lange-fc: mini-batch 60: final test accuracy"], strength="small-scale stand-in"),
    Claim("lange/fig3-cifar", "§5, Fig. 3 (right)", "the same on CIFAR-10: BNP and BN comparable, above vanilla "
          "and LN", "figure", not_checked=_CIFAR),
    Claim("lange/fig4-batch6", "§5, Fig. 4 (left)", "at mini-batch 6 BNP outperforms BN and the vanilla network; "
          "Batch Renorm and LN come close", "figure",
          checks=["lange-fc: mini-batch 6: BNP − BN", "lange-fc: mini-batch 6: BNP − vanilla"],
          strength="small-scale stand-in",
          note="MNIST stands in for CIFAR-10"),
    Claim("lange/fig4-batch1-bn", "§5, Fig. 4 (right)", "at mini-batch 1 BN and Batch Renorm do not train", "figure",
          checks=["lange-fc: BN at mini-batch size 1", "lange-fc: Batch Renorm at mini-batch size 1",
                  "lange-cnn-batch1: BN at mini-batch 1 does not train",
                  "lange-cnn-batch1: Batch Renorm at mini-batch 1 does not train",
                  "advise-validation: batch1-bn"],
          tests=[_T + "nets/test_norms.py::test_batch_of_one_is_rejected_in_training_but_not_in_eval"],
          strength="exact formula"),
    Claim("lange/fig4-batch1-bnp", "§5, Fig. 4 (right), abstract", "BNP trains online (mini-batch 1), faster than "
          "the vanilla network", "figure",
          checks=["lange-fc: BNP test accuracy at mini-batch size 1",
                  "lange-cnn-batch1: BNP above vanilla at mini-batch 1", "advise-validation: batch1-bnp"],
          strength="small-scale stand-in"),
    Claim("lange/fig4-cnn1", "§5, Fig. 4 (right)", "the 5-layer CNN at mini-batch 1: BNP trains faster and reaches "
          "slightly higher accuracy than vanilla; BN with 4 Things significantly underperforms", "figure",
          checks=["lange-cnn-batch1: BNP above vanilla at mini-batch 1",
                  "lange-cnn-batch1: BN with 4 things below vanilla and BNP at mini-batch 1"],
          strength="small-scale stand-in",
          note="MNIST stands in for CIFAR-10 (one pass over 500 images, 3 seeds); bnlab's BN with 4 things "
          "(bnlab.nets 'bn4', built from the paper's one-sentence description) is GroupNorm at batch 1 and "
          "does not underperform there (docs/optim.md)"),
    Claim("lange/fig5-128", "§5, Fig. 5 (left)", "5-layer CNN at mini-batch 128: BN, BN with 4 Things and BNP "
          "comparable (BNP slightly slower at first), all above vanilla", "figure",
          checks=["lange-fig5: mini-batch 128: final test accuracy", "lange-fig5: mini-batch 128: BN above vanilla",
                  "lange-fig5: mini-batch 128: BN w/ 4 things comparable to BN"],
          strength="small-scale stand-in",
          note="BN with 4 Things ('bn4', Adam at Table 3's 5e-3) runs at medium scale only, one seed as BN's there"),
    Claim("lange/fig5-2", "§5, Fig. 5 (right)", "at mini-batch 2 BNP significantly outperforms BN, Batch Renorm "
          "and BN with 4 Things; BN is the worst", "figure",
          checks=["lange-fig5: mini-batch 2: BNP − BN", "lange-fig5: mini-batch 2: BNP − Batch Renorm",
                  "lange-fig5: mini-batch 2: BNP − BN w/ 4 things", "lange-fig5: mini-batch 2: BN w/ 4 things above BN"],
          strength="small-scale stand-in",
          note="BN with 4 Things ('bn4', Adam at Table 3's 1e-4) at medium scale only, seeds 0-2 as BN's there; "
          "there bnlab's BN with 4 Things is ahead of BNP, not behind (docs/optim.md)"),
    Claim("lange/smallest-batch", "§5 'Convolutional Neural Networks'", "on the CNN, BN and Batch Renorm work well "
          "for mini-batches as small as 4 and 3", "headline",
          checks=["lange-cnn-min-batch: smallest mini-batch at which BN works",
                  "lange-cnn-min-batch: smallest mini-batch at which Batch Renorm works"],
          strength="small-scale stand-in",
          note="'works well' is undefined in the paper: here ≥ 0.9 × the method's accuracy at mini-batch 8 (MNIST, "
          "one pass over 600 images at small scale, seed means of seeds 0-2; the seeds' spread is as large as the "
          "gaps the criterion separates, so both rows are too close to call there and not judged: BN's B = 4 sits "
          "at 0.91 × its B = 8 accuracy, docs/optim.md)"),
    Claim("lange/bn4things", "§5, Figs. 4–5", "BN with 4 Things (Summers & Dinneen 2020) is comparable at 128 and "
          "falls behind BNP at mini-batch 2 and 1", "figure",
          checks=["lange-cnn-batch1: BN with 4 things below vanilla and BNP at mini-batch 1",
                  "lange-fig5: mini-batch 128: BN w/ 4 things comparable to BN",
                  "lange-fig5: mini-batch 2: BNP − BN w/ 4 things"],
          strength="small-scale stand-in",
          note="mini-batches 128 and 2 at lange-fig5's medium scale only (the small grid is sized for bnlab "
          "report's 10 minutes); mini-batch 1 in lange-cnn-batch1; bnlab's BN with 4 things (its reading of the "
          "paper's one-sentence description, with Adam) does not fall behind BNP at 2 or 1 (docs/optim.md)"),
    Claim("lange/fig6-cifar10", "§5, Fig. 6 (left)", "ResNet-110 on CIFAR-10: BNP+GN converges faster than BN before "
          "the first decay, is comparable after; BN and BNP+GN beat GN; BNP alone gains little at the decay", "figure",
          checks=["lange-fig6: trains", "lange-fig6: pre-decay speed", "lange-fig6: final accuracy",
                  "lange-fig6: GN behind", "lange-fig6: decay gain"], strength="paper scale",
          note="declared at paper scale (CIFAR and a GPU); the small scale is skipped with the reason"),
    Claim("lange/fig6-cifar100", "§5, Fig. 6 (right)", "pre-activation ResNet-110 on CIFAR-100: BNP+GN faster before "
          "the first decay, slightly below BN after; both beat GN", "figure",
          checks=["lange-fig6: final accuracy", "lange-fig6: GN behind"], strength="paper scale",
          note="declared at paper scale (CIFAR-100 and a GPU)"),
    Claim("lange/fig7", "§5, Fig. 7", "ResNet-18 on ImageNet: BNP+GN faster than BN before the first decay, "
          "slightly lower after the second; both beat GN", "figure",
          checks=["lange-fig7: trains", "lange-fig7: pre-decay speed", "lange-fig7: final accuracy",
                  "lange-fig7: GN behind", "lange-fig7: decay gain"], strength="paper scale",
          note="needs ImageNet: bnlab's paper scale runs CIFAR-10 in its place"),
    Claim("lange/fig8-left", "§5.1, Fig. 8 (left)", "BNP converges faster than the vanilla network (2×100 FC, "
          "mini-batch 60)", "figure",
          checks=["lange-fig8: final test accuracy, BNP vs vanilla"], strength="small-scale stand-in"),
    Claim("lange/fig8-center", "§5.1, Fig. 8 (center)", "BNP's preconditioning reduces the condition number of "
          "one neuron's Hessian block by roughly κ(D)²", "figure",
          checks=["lange-fig8: κ reduction against κ(D)²"], strength="small-scale stand-in",
          note="MNIST stands in for CIFAR-10"),
    Claim("lange/fig8-right", "§5.1, Fig. 8 (right)", "κ(D) is between 10² and 10⁵ in this small network", "figure",
          checks=["lange-fig8: κ(D) of the output layer's input"], strength="small-scale stand-in"),
    Claim("lange/fig9-table1", "§5.1, Fig. 9, Table 1", "an epoch of BNP takes about as long as one of BN "
          "(slower at mini-batch 16, slightly faster at 256 and 512)", "table",
          not_checked="measured by benchmarks/bench_bnp_epoch.py (docs/optim.md), not judged: the paper's V100 "
          "times and bnlab's CPU times are not comparable"),
    Claim("lange/table2", "App. B, Table 2", "the best learning rates of the FC networks per method and batch size",
          "table", not_checked="bnlab uses Table 2's rates (tests/optim/test_train_cli.py::test_default_learning_"
          "rates_follow_table2) but does not repeat the search that found them"),
    Claim("lange/table3", "App. B, Table 3", "the best learning rates of the CNNs and ResNets", "table",
          not_checked="bnlab uses Table 3's rates but does not repeat the search"),
    Claim("lange/abstract-online", "Abstract, §6", "BNP is not constrained on the mini-batch size and works in "
          "the online setting", "headline",
          checks=["lange-fc: BNP test accuracy at mini-batch size 1",
                  "lange-cnn-batch1: BNP above vanilla at mini-batch 1"], strength="small-scale stand-in"),
    Claim("lange/abstract-small-batch", "Abstract, §1, §5", "BNP performs comparably to BN in general and "
          "outperforms it at very small mini-batch sizes", "headline",
          checks=["lange-fc: mini-batch 60: final test accuracy", "lange-fc: mini-batch 6: BNP − BN",
                  "lange-fig5: mini-batch 2: BNP − BN"], strength="small-scale stand-in"),
    Claim("lange/abstract-equivalence", "Abstract, §6", "BNP is equivalent to BN over one training iteration when "
          "the back-propagation does not pass through the mini-batch statistics", "headline",
          tests=[_T + "optim/test_bnp_dense.py::test_proposition7_bn_step_equals_bnp_step"],
          strength="exact formula"),
]
