"""Yang, Pennington, Rao, Sohl-Dickstein & Schoenholz 2019, "A Mean Field Theory of Batch Normalization"
(ICLR): its claims and where bnlab checks them (see :mod:`bnlab.claims.core`).  Theorem numbers are the
ICLR version's (the appendix letters of arXiv 1902.08129)."""
from __future__ import annotations

from bnlab.claims.core import Claim, Paper

__all__ = ["PAPER", "CLAIMS"]

PAPER = Paper("yang2019", "Yang et al. 2019 (ICLR), A Mean Field Theory of Batch Normalization",
              "Yang et al. 2019")

_T = "tests/"
_TH = _T + "theory/"
_YC = _TH + "test_yang_claims.py::"
_DEPTH = ["max trainable depth at", "cells with depth ≥ 2·16ξ that fail to train", "cells with depth ≤ 16ξ/2 that train"]


def _depth(name: str) -> list[str]:
    return [f"{name}: {c}" for c in _DEPTH]


CLAIMS = [
    # ------------------------------------------------------------------ §3 the batchnorm mean field
    Claim("yang2019/def3.1", "§3, Def. 3.1, Props. E.8, E.10, E.14", "V_φ(Σ) = E[φ(h)φ(h)ᵀ], h ~ N(0, Σ); for "
          "α-ReLU V(q) = c_α q^α and the off-diagonal is the arccosine kernel J_α (Cho & Saul)", "formula",
          tests=[_TH + "test_vphi.py::test_alpha_relu_kernel_matches_cho_saul_j1_j2",
                 _TH + "test_vphi.py::test_quadrature_vs_montecarlo",
                 _TH + "test_vphi.py::test_closed_vs_quadrature"], strength="exact formula"),
    Claim("yang2019/prop-e11", "App. E, Prop. E.11", "J_α is increasing and convex on [0, 1] with J_α(1) = 1",
          "formula", tests=[_TH + "test_vphi.py::test_alpha_relu_kernel_properties"], strength="exact formula"),
    Claim("yang2019/prop-e23", "App. E, Prop. E.23", "the derivative of V_φ for positive-homogeneous φ", "formula",
          tests=[_TH + "test_vphi.py::test_prop_e23_derivative_erratum"], strength="exact formula",
          note="bnlab reports an erratum in the printed derivative (see the test)"),
    Claim("yang2019/eq8", "§3.1, Eq. 8", "for wide BN networks the batch covariance follows Σ^l = V_Bφ(Σ^{l−1}), "
          "B_φ(h) = φ(√B Gh/‖Gh‖)", "formula",
          tests=[_TH + "test_nngp.py::test_kernel_matches_finite_width_ensemble",
                 _TH + "test_batchnorm_map.py::test_generic_sigma_laplace_vs_qmc_sphere_and_montecarlo",
                 _TH + "test_batchnorm_map.py::test_depends_only_on_g_sigma_g"],
          checks=["yang2019-width: log–log slope of the bias"], strength="simulation",
          note="the mean-field limit itself (finite-width bias shrinking as 1/N) is yang2019-width's check"),
    Claim("yang2019/thm3.2", "§3.1, Thm 3.2 (Eq. 9), Thm E.5", "Laplace method: V_Bφ(Σ) as a one-dimensional "
          "integral of V_φ(Σ^G(I + 2sΣ^G)⁻¹) for degree-α positive-homogeneous φ", "formula",
          tests=[_TH + "test_batchnorm_map.py::test_generic_sigma_laplace_closed_vs_quadrature_kernel",
                 _TH + "test_batchnorm_map.py::test_laplace_printed_eq26_is_an_erratum"],
          strength="exact formula", note="bnlab reports an erratum in one printed Laplace equation (see the test)"),
    Claim("yang2019/thm3.3", "§3.1, Thm 3.3 (Eq. 10), Prop. E.34", "spherical integration: V_Bφ(Σ) as an "
          "expectation over the (B−2)-sphere", "formula",
          tests=[_TH + "test_batchnorm_map.py::test_generic_sigma_laplace_vs_qmc_sphere_and_montecarlo",
                 _TH + "test_batchnorm_map.py::test_basis_of_eq33_and_corrected_eq34"],
          strength="exact formula"),
    Claim("yang2019/fourier", "§3.1, App. E.2", "Fourier method: V_Bφ(Σ) for general φ through the Fourier "
          "transform", "formula",
          tests=[_TH + "test_fourier.py::test_general_phi_generic_sigma_vs_montecarlo_and_qmc",
                 _TH + "test_fourier.py::test_homogeneous_generic_sigma_vs_laplace",
                 _TH + "test_fourier.py::test_identity_exact"], strength="exact formula"),
    Claim("yang2019/thm3.4", "§3.1, Thm 3.4, Thm F.13", "the BSB1 fixed point's q*, q*c* are diagonal quadratic "
          "forms of φ's Gegenbauer coefficients", "formula",
          tests=[_TH + "test_fixed_point.py::test_general_phi_gegenbauer_sphere_fourier_agree",
                 _TH + "test_fixed_point.py::test_gegenbauer_large_b_tanh_matches_sphere"],
          strength="exact formula"),
    Claim("yang2019/thm3.5", "§3.1, Thm 3.5 (Eq. 11)", "for ReLU q* = ½ and c* = J₁(−1/(B−1)) = 1/π − 1/(2(B−1)) + "
          "O((B−1)⁻²)", "formula",
          tests=[_TH + "test_fixed_point.py::test_relu_closed_form_thm35",
                 _TH + "test_fixed_point.py::test_relu_large_b_asymptotics",
                 _TH + "test_fixed_point.py::test_montecarlo_agrees_within_three_standard_errors"],
          strength="exact formula"),
    Claim("yang2019/thm-f5", "App. F, Thm F.5, Thm F.8", "the BSB1 fixed point is unique; for positive-homogeneous "
          "φ it has a closed form", "formula",
          tests=[_TH + "test_fixed_point.py::test_closed_form_vs_numerical_routes",
                 _TH + "test_fixed_point.py::test_iterate_converges_to_closed_form_relu"],
          strength="exact formula"),
    Claim("yang2019/bsb1-convergence", "§3.1, Assumption 1", "for ReLU, leaky ReLU, tanh, sigmoid, … Σ^l converges "
          "to the BSB1 fixed point", "headline",
          tests=[_T + "sim/test_theory_agreement.py::test_covariance_approaches_bsb1_fixed_point",
                 _TH + "test_nngp.py::test_deep_kernel_reaches_the_bsb1_fixed_point",
                 _TH + "test_nngp.py::test_deep_tanh_kernel_reaches_the_bsb1_fixed_point"],
          strength="simulation", note="ReLU and tanh are tested; leaky ReLU and sigmoid are not"),
    Claim("yang2019/cor-f3", "§3.1 and App. F, Cor. F.3", "for φ = id the dynamics converge globally to the BSB1 "
          "fixed point (at a stated rate)", "formula",
          tests=[_YC + "test_cor_f3_identity_dynamics_converge_globally_at_rate_c_over_c_plus_2"],
          strength="exact formula", note="rank C = 2, 3, 5 at B = 6, through Lemma F.1's 1-D integral"),
    Claim("yang2019/fig1cd", "§3.1, Fig. 1 (c, d)", "α-ReLU shows a BSB1 → BSB2 symmetry-breaking transition: the "
          "variance of Σ's entries jumps at α_transition(B)", "figure",
          tests=[_TH + "test_symmetry.py::test_alpha_transition_bracketed_and_confirmed_by_iteration"],
          checks=["yang2019-fig1cd: jump of the variance"], strength="simulation"),
    Claim("yang2019/alpha-transition-b", "§3.1 (α_transition(B))", "the transition point α_transition depends on "
          "the batch size (it decreases as B grows)", "formula",
          tests=[_TH + "test_symmetry.py::test_alpha_transition_decreases_with_batch_size"], strength="simulation"),
    # ------------------------------------------------------------------ §3.1.1 linearized forward dynamics
    Claim("yang2019/thm3.6", "§3.1.1, Thm 3.6, Thms E.61–E.62", "G⊗2∘T∘G⊗2 of an ultrasymmetric T has eigenspaces "
          "{Σ^G = 0} (0), RG, L (B−1-dim) and M (B(B−3)/2-dim), orthogonal, so it is self-adjoint", "formula",
          tests=[_TH + "test_ultrasymmetric.py::test_projected_eigenvalues_match_dense_diagonalization",
                 _TH + "test_ultrasymmetric.py::test_projected_eigenvalues_property",
                 _TH + "test_ultrasymmetric.py::test_printed_ten_bracket_formula_is_wrong_when_12_13_differs_from_12_31"],
          strength="exact formula",
          note="erratum: the printed eigenvalue formulas of Thms E.61/E.62 are wrong when [12|13] ≠ [12|31]"),
    Claim("yang2019/thm3.7", "§3.1.1, Thm 3.7 (Eqs. 13–14)", "for ReLU, λ_L↑ ↗ 1 and λ_M↑ ↗ π/(2(π−1)) ≈ 0.733 as "
          "B → ∞ (closed forms at every B > 3)", "formula",
          tests=[_TH + "test_forward.py::test_relu_limits_thm_3_7",
                 _TH + "test_symmetry.py::test_relu_eigenvalues_match_thm_3_7",
                 _TH + "test_forward.py::test_every_method_agrees_with_direct_jacobian_of_the_forward_map",
                 _TH + "test_large_batch.py::test_relu_forward_lambda_L_is_one_minus_an_exact_gap"],
          checks=["yang2019-theory: relu λ_L↑, λ_M↑"], strength="exact formula"),
    Claim("yang2019/thm3.8", "§3.1.1, Thm 3.8 (Eq. 15), Thms F.22, F.24", "λ_L↑ and λ_M↑ as ratios of quadratic "
          "forms of the Gegenbauer coefficients", "formula",
          tests=[_TH + "test_forward.py::test_gegenbauer_large_b_finite_and_matches_sphere",
                 _TH + "test_forward.py::test_relu_gegenbauer_at_b1024",
                 _TH + "test_forward.py::test_kinked_gegenbauer_vs_laplace"], strength="exact formula"),
    Claim("yang2019/lm-ordering", "§3.1.1 after Thm 3.8", "λ_M↑ is typically much smaller than λ_L↑ (exceptions "
          "like φ = sin)", "formula",
          tests=[_YC + "test_lambda_m_smaller_than_lambda_l_holds_for_relu_like_phi_but_not_for_tanh_like"],
          strength="exact formula",
          note="holds for relu-like φ (by a factor 0.7–0.9, not 'much'); reversed for tanh, erf, sigmoid, elu, "
          "selu as well as sin"),
    Claim("yang2019/fig10-wv", "App. F, Fig. 10", "w_{B−1,1} < v_{B−1,1} but w_{B−1,l} ≥ v_{B−1,l} for l ≥ 2: the "
          "more linear φ, the smaller λ_L↑", "figure",
          not_checked="the coefficients w, v of Thm 3.8 enter bnlab's Gegenbauer route for λ_L↑ (tested under "
          "yang2019/thm3.8), but no test asserts Fig. 10's inequalities between them"),
    Claim("yang2019/thm-f33", "App. F, Thm F.33", "Laplace closed forms of the forward eigenvalues for "
          "positive-homogeneous φ", "formula",
          tests=[_TH + "test_forward.py::test_alpha_relu_laplace_closed_form_vs_sphere_and_gegenbauer",
                 _TH + "test_forward.py::test_laplace_vs_sphere_for_homogeneous_phi"], strength="exact formula"),
    Claim("yang2019/prop-f34", "App. F, Prop. F.34", "the large-B limits of the forward eigenvalues for "
          "degree-α positive-homogeneous φ", "formula",
          tests=[_YC + "test_prop_f34_large_batch_expansion_and_its_erratum",
                 _YC + "test_prop_f34_consequence_l_dominates_iff_alpha_at_least_one"],
          strength="exact formula",
          note="erratum: the printed 1/B coefficients hold only at α = 1; the corrected ones are asserted"),
    # ------------------------------------------------------------------ §3.1.2 gradients
    Claim("yang2019/thm3.9", "§3.1.2, Thm 3.9, Thm G.5", "gradients explode at the rate λ_G↓ given by the "
          "Gegenbauer coefficients of φ", "formula",
          tests=[_TH + "test_backward.py::test_every_method_agrees_with_autograd_backward_map",
                 _TH + "test_backward.py::test_montecarlo_within_three_standard_errors",
                 _TH + "test_backward.py::test_kinked_rate_gegenbauer_vs_closed_forms"],
          checks=["yang2019-theory: λ_G↓ routes"], strength="exact formula"),
    Claim("yang2019/thm3.9-explode", "§3.1.2, Thm 3.9 ('Batchnorm causes gradient explosion')", "λ_G↓ > 1 for every "
          "non-constant φ: the explosion cannot be removed by the weight variances or the nonlinearity", "formula",
          checks=["yang2019-theory: λ_G↓ > 1 for every φ"], strength="exact formula"),
    Claim("yang2019/thm3.9-linear", "§3.1.2, Thm 3.9", "λ_G↓ is minimized iff φ is linear, at (B−2)/(B−3)",
          "formula",
          tests=[_TH + "test_backward.py::test_identity_rate_is_exactly_b_minus_2_over_b_minus_3",
                 _TH + "test_analyze.py::test_gamma_beta_make_phi_more_linear"],
          checks=["yang2019-theory: identity λ_G↓"], strength="exact formula",
          note="the linear value is tested exactly; that every other φ is above it is tested for tanh only"),
    Claim("yang2019/jacobian-sv", "§3.1.2 after Thm 3.9", "batchnorm forces the layer Jacobian's singular values away "
          "from 1 at initialization (disproving Ioffe & Szegedy's conjecture)", "formula",
          tests=[_YC + "test_sec312_bn_layer_jacobian_singular_values_are_pushed_away_from_one"],
          strength="exact formula", note="φ = id: the closed form at the mean-field fixed point and a finite network"),
    Claim("yang2019/thm3.10", "§3.1.2, Thm 3.10 (Eq. 19), Thm G.12", "ReLU-BN gradients explode at the closed-form "
          "rate of Eq. 19, decreasing to π/(π−1) ≈ 1.467 as B → ∞; the linear BN network at (B−2)/(B−3) → 1",
          "formula",
          tests=[_TH + "test_backward.py::test_relu_rate_decreases_to_pi_over_pi_minus_1",
                 _TH + "test_backward.py::test_laplace_thm_g12_vs_sphere",
                 _T + "sim/test_theory_agreement.py::test_gradient_explosion_rate_width_1000",
                 _T + "nets/test_train.py::test_initial_gradient_explosion_rate_matches_thm_3_10"],
          checks=["yang2019-theory: relu λ_G↓"], strength="exact formula"),
    Claim("yang2019/fig1a", "§3.1.2, Fig. 1a", "Monte Carlo λ_G of ReLU-BN networks (width 1000, 200 nets) matches "
          "the theory as a function of B", "figure",
          checks=["yang2019-fig1ab: λ_G, ReLU, B"], strength="simulation"),
    Claim("yang2019/fig1b", "§3.1.2, Fig. 1b", "the gradient magnitude grows with depth as the theory predicts",
          "figure", tests=[_T + "sim/test_theory_agreement.py::test_gradient_explosion_rate_small"],
          checks=["yang2019-fig1ab: λ_G, ReLU, B"], strength="simulation"),
    Claim("yang2019/app-l", "§3.1.2 'Weight Gradient', App. L", "the weight-gradient norm at layer l is μ* tr Π^l, "
          "so weight gradients explode at the same rate λ_G↓", "formula",
          tests=[_TH + "test_backward.py::test_weight_gradient_norms_follow_the_trace_of_the_dense_backward_recursion",
                 _T + "sim/test_conditional.py::test_weight_gradient_from_the_layers_grams_equals_the_direct_measurement",
                 _T + "sim/test_theory_agreement.py::test_gradient_explosion_rate_small"],
          strength="exact formula"),
    Claim("yang2019/epsilon", "§3.1.2 'Effect of ε'", "a larger ε than usual ameliorates, but does not eliminate, "
          "gradient explosion", "formula",
          tests=[_TH + "test_epsilon.py::test_larger_eps_reduces_gradient_explosion",
                 _TH + "test_epsilon.py::test_gradient_rate_against_autograd_monte_carlo",
                 _TH + "test_epsilon.py::test_fixed_point_against_monte_carlo"], strength="exact formula"),
    Claim("yang2019/app-b", "App. B, Assumption 2", "computing backprop with an independent copy of W (gradient "
          "independence) agrees with simulations", "headline",
          tests=[_T + "sim/test_theory_agreement.py::test_gradient_explosion_rate_explicit_weights",
                 _T + "sim/test_theory_agreement.py::test_agrees_with_theory_engine"], strength="simulation"),
    # ------------------------------------------------------------------ §3.2 cross-batch dynamics
    Claim("yang2019/cbsb1", "§3.2, Eq. 21, Thm H.3, Cor. H.4", "two batches converge to a cross-batch BSB1 fixed "
          "point whose off-diagonal entries are one constant c*_CB", "formula",
          tests=[_TH + "test_cross_batch.py::test_alpha_relu",
                 _TH + "test_cross_batch.py::test_every_method_agrees_with_direct_monte_carlo"],
          strength="exact formula"),
    Claim("yang2019/thm3.11", "§3.2, Thm 3.11 (Eq. 24), Thms H.13–H.14, I.4–I.5", "the cross-batch covariance "
          "converges at λ_M̃↑ = λ_M̃↓ (the cross-batch gradient decay) < 1, given by Eq. 24", "formula",
          tests=[_TH + "test_cross_batch.py::test_every_method_agrees_with_direct_monte_carlo",
                 _TH + "test_cross_batch.py::test_montecarlo_within_three_standard_errors",
                 _T + "sim/test_theory_agreement.py::test_cross_batch_correlation_decays_at_theory_rate"],
          checks=["yang2019-fig2: cross-batch decay per layer 1 − λ_M̃"], strength="exact formula"),
    Claim("yang2019/thm3.11-id", "§3.2, Thm 3.11, Cor. I.6", "the rate is maximized by φ = id, where it is "
          "(B−1)/2·P(B/2, ½)⁻², increasing to 1 from below as B → ∞", "formula",
          tests=[_TH + "test_cross_batch.py::test_identity_rate_thm_3_11",
                 _TH + "test_cross_batch.py::test_identity_maximizes_the_rate"],
          checks=["yang2019-theory: identity cross-batch rate"], strength="exact formula"),
    Claim("yang2019/thm-h13", "App. H, Thm H.13", "the full eigendecomposition of the cross-batch forward Jacobian "
          "F̃ (eigenspaces beyond M̃)", "formula",
          not_checked="bnlab computes only the M̃ eigenvalue (tested under yang2019/thm3.11); the other "
          "eigenspaces of F̃ are not computed"),
    Claim("yang2019/fig2", "§3.2, Fig. 2 (and Fig. 6)", "a linear BN network maps two nearly identical minibatches "
          "to increasingly dissimilar ones: batch norm makes the input–output map chaotic", "figure",
          checks=["yang2019-fig2: correlation of two nearly identical minibatches"], strength="simulation"),
    # ------------------------------------------------------------------ §4 experiments
    Claim("yang2019/16xi", "§4", "trainability is controlled by gradient explosion: the maximum trainable depth is "
          "about 16ξ, ξ = 1/log λ_G↓", "headline",
          checks=_depth("yang2019-fig3a") + _depth("yang2019-fig5b") + _depth("yang2019-fig5c-sigma4")
          + ["advise-validation: depth-below", "advise-validation: depth-above"], strength="small-scale stand-in"),
    Claim("yang2019/50-layers", "§4, Fig. 3a", "ReLU-BN networks deeper than about 50 layers are untrainable "
          "regardless of batch size", "headline",
          checks=["yang2019-theory: 16ξ for relu, B → ∞",
                  "yang2019-fig3a: cells with depth ≥ 2·16ξ that fail to train"], strength="small-scale stand-in"),
    Claim("yang2019/fig3a", "§4, Fig. 3a", "ReLU, SGD, MNIST: the trainable region of depth × B follows 16ξ", "figure",
          checks=_depth("yang2019-fig3a"), strength="small-scale stand-in",
          note="width 128, 600 SGD steps at 100× the paper's η (η·steps as in the paper)"),
    Claim("yang2019/fig3b", "§4, Fig. 3b", "with the training batch fixed and BN over sub-batches of B the trainable "
          "region is nearly identical (not a gradient-noise effect)", "figure",
          checks=_depth("yang2019-fig3b"), strength="small-scale stand-in"),
    Claim("yang2019/fig3c", "§4, Fig. 3c", "with RMSProp the trainable region is nearly identical", "figure",
          checks=_depth("yang2019-fig3c"), strength="small-scale stand-in"),
    Claim("yang2019/fig3d", "§4, Fig. 3d", "on CIFAR-10 (50 epochs) the trainable region is nearly identical",
          "figure", checks=_depth("yang2019-fig3d"), strength="small-scale stand-in",
          note="skipped unless CIFAR-10 has been downloaded"),
    Claim("yang2019/fig4a", "§4, Fig. 4a", "after one SGD step the weights grow exponentially with depth", "figure",
          checks=["yang2019-fig4: ‖W^1‖ after one step / before"], strength="small-scale stand-in"),
    Claim("yang2019/fig4b", "§4, Fig. 4b", "before learning, ‖∂L/∂h^l‖ explodes with depth at the rate λ_G↓",
          "figure", checks=["yang2019-fig4: initial ‖∂L/∂h^l‖² growth per layer"], strength="small-scale stand-in"),
    Claim("yang2019/fig4c", "§4, Fig. 4c", "after a single step the weight gradients' magnitudes stabilize: networks "
          "with BN quickly reach dynamical equilibrium", "figure",
          checks=["yang2019-fig4: dynamic range of ‖∂L/∂W^l‖"], strength="small-scale stand-in"),
    Claim("yang2019/fig5a", "§4, Fig. 5a", "tanh: decreasing the pre-activation scale γ (towards linear) raises the "
          "maximum trainable depth as 16ξ predicts", "figure", checks=_depth("yang2019-fig5a"),
          strength="small-scale stand-in"),
    Claim("yang2019/fig5b", "§4, Fig. 5b", "ReLU: increasing the shift β raises the maximum trainable depth as 16ξ "
          "predicts", "figure", checks=_depth("yang2019-fig5b"), strength="small-scale stand-in"),
    Claim("yang2019/fig5c", "§4, Fig. 5c", "tanh: a well-defined phase transition in ε near 1, beyond which very deep "
          "nets train", "figure",
          checks=_depth("yang2019-fig5c") + _depth("yang2019-fig5c-sigma4")
          + ["yang2019-fig5c-sigma4: worst ε column at σ_w²", "yang2019-fig5c-sigma4: ε = 1 at σ_w²"],
          strength="small-scale stand-in",
          note="contradicted at small scale: at σ_w² = 1 the ε = 1 column trains worst.  BN(σh; ε) = BN(h; ε/σ²), "
          "so the BSB1 collapse sits at ε = σ_w²; yang2019-fig5c-sigma4 (σ_w² = 4) tests that explanation: ε = 1 "
          "no longer trains worst, but ε = σ_w² is not the worst column either — the small-scale result is the "
          "collapse together with the large step (docs/trainability.md)"),
    Claim("yang2019/fig5d", "§4, Fig. 5d", "ReLU with β = 2: the same transition in ε near 1", "figure",
          checks=_depth("yang2019-fig5d"), strength="small-scale stand-in",
          note="small scale runs β = 0.5 (β = 2 puts 16ξ beyond any affordable depth grid); the medium scale runs "
          "the paper's β = 2 with depths 40–720 at the small budget per network (150 SGD steps at 1e-3·B).  That run "
          "(`bnlab reproduce yang2019-fig5d --scale medium`, commit 2058583, 2026-11-27) trained only depth 40 at "
          "every ε (accuracy 0.66–0.74; depth 160: 0.12–0.19) against 16ξ = 333, 340, 430, ∞: the boundary lies "
          "4–10× below 16ξ, so at this budget it is set by the training length, not by the gradient explosion "
          "(as Fig. 3a's budget study found at β = 0); the direction of the claim shows — at ε = 1 (16ξ = ∞) depths "
          "160–720 reach 0.18–0.22 and none diverges, while at ε ≤ 0.1 depths 320–480 stay at chance and 720 "
          "diverges"),
    Claim("yang2019/abstract-linear", "Abstract, §5", "gradient explosion cannot be eliminated but can be reduced by "
          "tuning the network close to the linear regime, which improves trainability", "headline",
          tests=[_TH + "test_analyze.py::test_gamma_beta_make_phi_more_linear"],
          checks=_depth("yang2019-fig5a") + _depth("yang2019-fig5b"), strength="small-scale stand-in"),
    Claim("yang2019/fig7", "App. A, Fig. 7", "VGG19 with BN on CIFAR-100: after ~10 epochs the relative gradient "
          "norms of γ and W equilibrate across layers despite the initial explosion", "figure",
          not_checked="needs CIFAR-100 and VGG19 training (a GPU)"),
    Claim("yang2019/figs8-9", "App. A, Figs. 8–9", "ε > 0 and β > 0 initialization accelerate VGG19 training on "
          "CIFAR-100, especially early", "figure", not_checked="needs CIFAR-100 and a VGG19 sweep (a GPU)"),
    # ------------------------------------------------------------------ App. J, K: uncommon regimes
    Claim("yang2019/b2", "App. J 'Small Batch Size'", "at B = 2, B_φ(h) = (±1, ∓1): the gradient of a B = 2 "
          "batchnorm network is 0", "formula",
          tests=[_YC + "test_app_j_batch_size_two_has_exactly_zero_gradient"], strength="exact formula"),
    Claim("yang2019/b3", "App. J 'Small Batch Size'", "B = 3 suffers a gradient explosion similar to B = 4 "
          "(conjectured from simulation)", "formula",
          tests=[_YC + "test_app_j_batch_size_three_explodes_like_four"], strength="simulation",
          note="the typical (median) explosion: the mean-field rate does not exist at B = 3 (infinite mean)"),
    Claim("yang2019/finite-width-bsb2", "App. J 'Finite width effect'", "for φ = C₅ − C₇ (Gegenbauer) at B = 10, "
          "width 100 favours BSB2 fixed points, width ≥ 1000 BSB1", "formula",
          tests=[_YC + "test_app_j_c5_minus_c7_is_bsb1_stable_in_mean_field_but_breaks_symmetry_at_width_100",
                 _YC + "test_app_j_c5_minus_c7_returns_to_bsb1_at_large_width"],
          strength="simulation",
          note="here the turnover to BSB1 lies between widths 1 000 (11/16 networks still BSB2) and 3 000"),
    Claim("yang2019/thm-k4-k5", "App. K, Thms K.4–K.5", "the BSB2¹ fixed point's G-projection is rank one, "
          "λ*q̂q̂ᵀ, with the closed-form d*, c*, b*", "formula",
          tests=[_TH + "test_symmetry.py::test_bsb2_fixed_point_is_a_fixed_point"], strength="exact formula"),
    Claim("yang2019/thm-k2", "App. K, Thm K.2, Cor. K.3", "eigenspaces and eigenvalues of G·BSB2·G", "formula",
          not_checked="bnlab computes the BSB2¹ fixed point (yang2019/thm-k4-k5) but not the eigendecomposition of "
          "G·BSB2·G; no test"),
    Claim("yang2019/remark-k7", "App. K, Remark K.7", "in PyTorch the gradient of a relu³⁰ network at a BSB2¹ fixed "
          "point vanishes numerically", "formula",
          not_checked="the relu³⁰ BSB2¹ fixed point is tested (yang2019/thm-k4-k5), but no test takes a network's "
          "gradient there"),
]
