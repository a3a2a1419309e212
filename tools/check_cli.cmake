# Checks of the sparge tool's script-facing output (run by CTest with -DSPARGE=<tool> -DVERSION=<x.y.z>):
# --version, --json (parsed with string(JSON)), the default estimator and --estimator, --csv, GNU-style attached
# short options (-L256, -H2), and the order of stdout and stderr when both go to one pipe.
cmake_minimum_required(VERSION 3.22)

execute_process(COMMAND ${SPARGE} --version OUTPUT_VARIABLE out RESULT_VARIABLE rc)
if(NOT rc EQUAL 0 OR NOT out MATCHES "^sparge ${VERSION} \\(libsparge ${VERSION} loaded, CUDA backend: (yes|no)\\)\n$")
  message(FATAL_ERROR "--version: exit ${rc}, output '${out}'")
endif()

set(run --device cpu -H2 --hkv 1 -L256 --lkv=320 -D16 --causal --precision exact --iters 1 --warmup 0 --rows 32
    --no-progress)
execute_process(COMMAND ${SPARGE} ${run} --json OUTPUT_VARIABLE js ERROR_VARIABLE err RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "--json: exit ${rc}: ${err}")
endif()
string(JSON v GET "${js}" version)
string(JSON lq GET "${js}" problem Lq)
string(JSON lkv GET "${js}" problem Lkv)
string(JSON hq GET "${js}" problem Hq)
string(JSON causal GET "${js}" problem causal)
string(JSON ncalls LENGTH "${js}" calls)
string(JSON name3 GET "${js}" calls 3 name)
string(JSON cos3 GET "${js}" calls 3 cos_f64)
string(JSON density GET "${js}" blocks density)
if(NOT v STREQUAL VERSION OR NOT lq EQUAL 256 OR NOT lkv EQUAL 320 OR NOT hq EQUAL 2 OR NOT causal STREQUAL "ON"
   OR NOT ncalls EQUAL 4 OR NOT name3 MATCHES "^dense" OR cos3 LESS 0.999999 OR density GREATER 1)
  message(FATAL_ERROR "--json: unexpected values (version ${v}, Lq ${lq}, Lkv ${lkv}, Hq ${hq}, causal ${causal}, "
                      "${ncalls} calls, ${name3} cos ${cos3}, density ${density}) in:\n${js}")
endif()
if(NOT err STREQUAL "")
  message(FATAL_ERROR "--json --no-progress wrote to stderr: ${err}")
endif()

# The default estimator is auto, reported as the one it runs: keys_lse when causal, keys_lse_adaptive when not;
# --estimator mean selects the SpargeAttn rule.
string(JSON est GET "${js}" sparsity estimator)
set(run_nc ${run})
list(REMOVE_ITEM run_nc --causal)
execute_process(COMMAND ${SPARGE} ${run_nc} --json OUTPUT_VARIABLE js_nc RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "--json (not causal): exit ${rc}")
endif()
string(JSON est_nc GET "${js_nc}" sparsity estimator)
execute_process(COMMAND ${SPARGE} ${run_nc} --json --estimator keys_lse OUTPUT_VARIABLE js_lse RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "--json --estimator keys_lse: exit ${rc}")
endif()
string(JSON est_lse GET "${js_lse}" sparsity estimator)
execute_process(COMMAND ${SPARGE} ${run} --json --estimator mean OUTPUT_VARIABLE js_mean RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "--json --estimator mean: exit ${rc}")
endif()
string(JSON est_mean GET "${js_mean}" sparsity estimator)
if(NOT est STREQUAL "keys_lse" OR NOT est_nc STREQUAL "keys_lse_adaptive" OR NOT est_lse STREQUAL "keys_lse"
   OR NOT est_mean STREQUAL "mean")
  message(FATAL_ERROR "estimator: default '${est}' causal (expected keys_lse), '${est_nc}' not causal (expected "
                      "keys_lse_adaptive), --estimator keys_lse gives '${est_lse}', --estimator mean '${est_mean}'")
endif()

execute_process(COMMAND ${SPARGE} ${run} --csv OUTPUT_VARIABLE csv RESULT_VARIABLE rc)
string(REGEX MATCHALL "[^\n]+" lines "${csv}")
list(LENGTH lines n)
list(GET lines 0 header)
list(GET lines 4 last)
if(NOT rc EQUAL 0 OR NOT n EQUAL 5 OR NOT header MATCHES "^call,seconds,eff_tops,cos_f64,rel_l1,density,device,"
   OR NOT last MATCHES "^dense \\(all-ones mask\\),[0-9.e+-]+,[0-9.e+-]+,(1\\.0+|0\\.99999[0-9]*),.*,cpu,1,2,1,256,320,16,fp32,")
  message(FATAL_ERROR "--csv: exit ${rc}, ${n} lines:\n${csv}")
endif()

# One pipe for both streams: the report's header comes before the library's error.
execute_process(COMMAND ${SPARGE} --device cpu -L128 -H1 -D16 --topk 1.5 OUTPUT_VARIABLE both ERROR_VARIABLE both
                RESULT_VARIABLE rc)
string(FIND "${both}" "sparge ${VERSION}" at_header)
string(FIND "${both}" "SPARGE_ERR_INVALID_ARGUMENT" at_error)
if(NOT rc EQUAL 1 OR at_header LESS 0 OR at_error LESS at_header)
  message(FATAL_ERROR "merged output out of order (exit ${rc}):\n${both}")
endif()
message(STATUS "sparge tool: --version, --json, --estimator, --csv, -L256 and output order ok")
