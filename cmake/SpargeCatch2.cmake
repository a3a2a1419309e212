# Catch2 for the test suite: major version 2 or 3, whichever CMake finds.
#
# sparge_find_catch2(<found_var>) looks, in this order, for
#   1. SPARGE_CATCH2_INCLUDE_DIR (cache, or the environment variable of that name): a
#      directory holding the Catch2 v2 single header catch2/catch.hpp;
#   2. a Catch2 CMake package, find_package(Catch2 CONFIG): the distribution's
#      (Debian 12: 2.13; Ubuntu 24.04, Debian 13, conda-forge: 3.x), or one
#      that CMAKE_PREFIX_PATH, Catch2_ROOT or Catch2_DIR points at;
#   3. a catch2/catch.hpp v2 single header on the compiler's standard include path.
# On success it sets <found_var> TRUE and creates the INTERFACE target
# sparge_catch2: the Catch2 headers, for v3 the Catch2 library (not
# Catch2WithMain: the test programs define main() themselves), and the
# definition SPARGE_CATCH2_MAJOR=2|3 that tests/common/catch_compat.hpp reads.
# It also sets SPARGE_CATCH2_MAJOR, SPARGE_CATCH2_VERSION and SPARGE_CATCH2_WHERE;
# on failure SPARGE_CATCH2_WHY says what was found and why it was not taken.
# Used by the top-level CMakeLists.txt and by cmake/catch2-probe (scripts/deps.sh).

set(SPARGE_CATCH2_INSTALL_HINT
  "Debian/Ubuntu: apt-get install catch2 (Debian 12 ships v2, Ubuntu 24.04 and Debian 13 ship v3); conda: conda install -c conda-forge catch2; a Catch2 installed elsewhere: CMAKE_PREFIX_PATH=<its prefix>; a v2 single header: -DSPARGE_CATCH2_INCLUDE_DIR=<directory holding catch2/catch.hpp>")

# Reads CATCH_VERSION_MAJOR/MINOR/PATCH from a v2 single header.
function(_sparge_catch2_header_version header out_major out_version)
  file(STRINGS "${header}" _defs REGEX "^#define CATCH_VERSION_(MAJOR|MINOR|PATCH) [0-9]+")
  set(_maj "")
  set(_min 0)
  set(_pat 0)
  foreach(_d IN LISTS _defs)
    if(_d MATCHES "MAJOR ([0-9]+)")
      set(_maj "${CMAKE_MATCH_1}")
    elseif(_d MATCHES "MINOR ([0-9]+)")
      set(_min "${CMAKE_MATCH_1}")
    elseif(_d MATCHES "PATCH ([0-9]+)")
      set(_pat "${CMAKE_MATCH_1}")
    endif()
  endforeach()
  set(${out_major} "${_maj}" PARENT_SCOPE)
  set(${out_version} "${_maj}.${_min}.${_pat}" PARENT_SCOPE)
endfunction()

function(sparge_find_catch2 found_var)
  set(${found_var} FALSE PARENT_SCOPE)
  set(SPARGE_CATCH2_INCLUDE_DIR "" CACHE PATH
    "Directory holding the Catch2 v2 single header catch2/catch.hpp (instead of a Catch2 package)")
  set(_dir "${SPARGE_CATCH2_INCLUDE_DIR}")
  if(NOT _dir AND DEFINED ENV{SPARGE_CATCH2_INCLUDE_DIR})
    set(_dir "$ENV{SPARGE_CATCH2_INCLUDE_DIR}")
  endif()

  set(_major "")
  set(_version "")
  set(_where "")
  set(_target "")
  set(_incdir "")
  if(_dir)
    # 1. An explicit single-header directory: that or nothing.
    if(NOT EXISTS "${_dir}/catch2/catch.hpp")
      set(SPARGE_CATCH2_WHY "SPARGE_CATCH2_INCLUDE_DIR=${_dir} holds no catch2/catch.hpp" PARENT_SCOPE)
      return()
    endif()
    _sparge_catch2_header_version("${_dir}/catch2/catch.hpp" _major _version)
    set(_where "single header ${_dir}/catch2/catch.hpp")
    set(_incdir "${_dir}")
  else()
    # 2. A CMake package.
    find_package(Catch2 CONFIG QUIET)
    if(Catch2_FOUND)
      set(_major "${Catch2_VERSION_MAJOR}")
      set(_version "${Catch2_VERSION}")
      set(_where "package ${Catch2_DIR}")
      if(TARGET Catch2::Catch2)
        set(_target Catch2::Catch2)
      else()
        set(SPARGE_CATCH2_WHY "Catch2 ${_version} (${_where}) defines no Catch2::Catch2 target" PARENT_SCOPE)
        return()
      endif()
    else()
      # 3. A bare v2 single header on the standard include path.
      find_path(SPARGE_CATCH2_HEADER_DIR catch2/catch.hpp)
      if(SPARGE_CATCH2_HEADER_DIR)
        _sparge_catch2_header_version("${SPARGE_CATCH2_HEADER_DIR}/catch2/catch.hpp" _major _version)
        set(_where "single header ${SPARGE_CATCH2_HEADER_DIR}/catch2/catch.hpp")
        set(_incdir "${SPARGE_CATCH2_HEADER_DIR}")
      else()
        set(SPARGE_CATCH2_WHY "no Catch2 found (neither a Catch2 CMake package nor catch2/catch.hpp)" PARENT_SCOPE)
        return()
      endif()
    endif()
  endif()

  if(NOT _major STREQUAL "2" AND NOT _major STREQUAL "3")
    set(SPARGE_CATCH2_WHY "Catch2 ${_version} (${_where}) found, but the tests need major version 2 or 3"
      PARENT_SCOPE)
    return()
  endif()
  if(_major STREQUAL "3" AND _incdir)
    set(SPARGE_CATCH2_WHY "Catch2 ${_version} in ${_where}: a v3 needs its library, use its CMake package"
      PARENT_SCOPE)
    return()
  endif()

  if(NOT TARGET sparge_catch2)
    add_library(sparge_catch2 INTERFACE)
    if(_target)
      target_link_libraries(sparge_catch2 INTERFACE ${_target})
    else()
      target_include_directories(sparge_catch2 INTERFACE "${_incdir}")
    endif()
    target_compile_definitions(sparge_catch2 INTERFACE SPARGE_CATCH2_MAJOR=${_major})
  endif()
  set(SPARGE_CATCH2_MAJOR "${_major}" PARENT_SCOPE)
  set(SPARGE_CATCH2_VERSION "${_version}" PARENT_SCOPE)
  set(SPARGE_CATCH2_WHERE "${_where}" PARENT_SCOPE)
  set(${found_var} TRUE PARENT_SCOPE)
endfunction()
