/* Proves that the public header is valid C99 and that the C entry points link. */
#include <sparge/sparge.h>
#include <stdio.h>
#include <string.h>

int main(void) {
  sparge_problem_t prob = SPARGE_PROBLEM_INIT;
  sparge_predict_params_t params = SPARGE_PREDICT_PARAMS_INIT;
  sparge_plan_t plan = NULL;
  int major = -1, minor = -1, patch = -1;
  sparge_status_t st;

  sparge_version(&major, &minor, &patch);
  if (major != SPARGE_VERSION_MAJOR || minor != SPARGE_VERSION_MINOR || patch != SPARGE_VERSION_PATCH) {
    fprintf(stderr, "version mismatch\n");
    return 1;
  }
  if (params.struct_size != sizeof(params) || prob.struct_size != sizeof(prob)) return 1;
  if (params.estimator != SPARGE_ESTIMATOR_AUTO) return 1; /* the default estimator: the mode's */
  /* lengths 0 in the initializer: must be rejected with a message naming len_q */
  st = sparge_create_plan(&prob, &plan);
  if (st != SPARGE_ERR_INVALID_ARGUMENT || plan != NULL) return 1;
  if (strstr(sparge_last_error(), "len_q") == NULL) return 1;
  prob.len_q = 100;
  prob.len_kv = 200;
  prob.dtype = SPARGE_DTYPE_FLOAT32;
  prob.precision = SPARGE_PRECISION_EXACT;
  st = sparge_create_plan(&prob, &plan);
  if (st != SPARGE_OK) {
    fprintf(stderr, "create_plan: %s\n", sparge_last_error());
    return 1;
  }
  sparge_destroy_plan(plan);
  sparge_destroy_plan(NULL);
  printf("C99 header OK: %s\n", sparge_status_string(SPARGE_OK));
  return 0;
}
