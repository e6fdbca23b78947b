/*
 * cli_router.c: the names of the routers (and of the schedules) on the command line, shared by
 * `tilewave plan`, `bench` and `sweep` so that every command accepts and prints the same
 * spellings.
 */
#include <math.h>
#include <stdlib.h>
#include <strings.h>

#include "cli.h"
#include "tilewave.h"

int tw__cli_parse_router(const char* v, int* router, double* param) {
  if (v == NULL) return 0;
  if (strcasecmp(v, "balanced") == 0) {
    *router = TW_ROUTER_BALANCED;
  } else if (strcasecmp(v, "moderate_skew") == 0) {
    *router = TW_ROUTER_MODERATE_SKEW;
  } else if (strcasecmp(v, "stress_skew") == 0) {
    *router = TW_ROUTER_STRESS_SKEW;
  } else if (strncasecmp(v, "target:", 7) == 0) {
    char* end = NULL;
    const double r = strtod(v + 7, &end);
    if (v[7] == '\0' || *end != '\0' || !isfinite(r) || !(r >= 1.0)) return 0;
    *router = TW_ROUTER_TARGET;
    *param = r;
    return 1;
  } else {
    return 0;
  }
  *param = 0.0;
  return 1;
}

const char* tw__cli_router_name(int router) {
  switch (router) {
    case TW_ROUTER_BALANCED:
      return "balanced";
    case TW_ROUTER_MODERATE_SKEW:
      return "moderate_skew";
    case TW_ROUTER_STRESS_SKEW:
      return "stress_skew";
    case TW_ROUTER_TARGET:
      return "target";
    case TWB_ROUTER_HOT:
      return "hot";
  }
  return "?";
}

const char* tw__cli_schedule_name(int schedule) {
  return schedule == TW_SCHEDULE_EXPERT_MAJOR   ? "expert-major"
         : schedule == TW_SCHEDULE_REMOTE_FIRST ? "remote-first"
                                                : "?";
}
