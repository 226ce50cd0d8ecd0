# Sourced by launch_multinode.sh (inside the image too) and test_container.sh: processes read from /proc, since
# slim images (Debian minbase) have no pgrep.

children_of() {  # pids whose parent is $1
    local stat_file stat fields
    for stat_file in /proc/[0-9]*/stat; do
        stat="$(cat "$stat_file" 2>/dev/null)" || continue
        read -r -a fields <<< "${stat##*) }"  # after "pid (comm) ": state ppid ...; comm may hold spaces
        [ "${fields[1]:-}" = "$1" ] && { stat_file="${stat_file#/proc/}"; echo "${stat_file%/stat}"; }
    done
    return 0
}
