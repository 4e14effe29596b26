// The resident set's plan (`dual_cache/transfer/resident_set.py`, `ResidentSet.plan`; its pure-torch reference is
// `ResidentSet._plan_reference`, which defines every number here): per (sequence, KV head) row of the set, which of
// the positions a decode step wants are not resident yet and which slots they go to. Built into the same library as
// the selection engine (`native.py`); plain loops over one row at a time, a few microseconds per row.

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

extern "C" {

// Plan one step for `groups` rows of a resident set of `capacity` slots each.
//   held, stamps: (groups, capacity) int64, the mirror: the position each slot holds (-1: empty) and the last step
//     it was wanted or attended; updated in place.
//   wanted: (groups, width) int64 positions the step wants resident (-1: none; repeats allowed).
//   used: (groups, used_width) int64 positions the previous step's real token attended (-1: none), or nullptr.
//   step: the plan's step number (the stamp of what it touches). exclusive: also empty every slot not wanted.
//   out_group, out_slot, out_position: (groups * max(width, capacity),) int64: per written slot its row, its slot in
//     the row and its new position (-1: emptied), row by row: the missing positions ascending, then (exclusive) the
//     emptied slots ascending.
//   totals: (2,) int64 out: the distinct wanted positions and how many of them were resident.
// Returns the number of written slots, or -1 - row when a row wants more distinct positions than it has slots that
// are not wanted (that row's stamps may have changed, later rows are untouched, earlier rows are planned: the caller
// plans on copies and keeps them only on success).
int64_t dc_plan(int64_t groups, int64_t capacity, int64_t width, int64_t used_width, int64_t* held, int64_t* stamps,
                const int64_t* wanted, const int64_t* used, int64_t step, int exclusive, int64_t* out_group,
                int64_t* out_slot, int64_t* out_position, int64_t* totals) {
  // sorted lists and merges (branch-predictable), no binary searches: a few microseconds per row
  std::vector<int64_t> want, used_sorted, missing, victims;
  std::vector<std::pair<int64_t, int64_t>> held_sorted;  // (position, slot)
  std::vector<char> is_wanted(capacity), written(capacity);
  int64_t count = 0, total_wanted = 0, total_resident = 0;
  for (int64_t g = 0; g < groups; ++g) {
    int64_t* h = held + g * capacity;
    int64_t* s = stamps + g * capacity;
    want.clear();
    for (int64_t j = 0; j < width; ++j)
      if (wanted[g * width + j] >= 0) want.push_back(wanted[g * width + j]);
    std::sort(want.begin(), want.end());
    want.erase(std::unique(want.begin(), want.end()), want.end());
    used_sorted.clear();
    if (used != nullptr) {
      for (int64_t j = 0; j < used_width; ++j)
        if (used[g * used_width + j] >= 0) used_sorted.push_back(used[g * used_width + j]);
      std::sort(used_sorted.begin(), used_sorted.end());
    }
    held_sorted.clear();
    for (int64_t c = 0; c < capacity; ++c)
      if (h[c] >= 0) held_sorted.emplace_back(h[c], c);
    std::sort(held_sorted.begin(), held_sorted.end());
    std::fill(is_wanted.begin(), is_wanted.end(), 0);
    // merge the held positions with the wanted ones: held and wanted, or wanted and missing
    missing.clear();
    size_t i = 0, j = 0;
    while (j < want.size()) {
      if (i < held_sorted.size() && held_sorted[i].first < want[j]) {
        ++i;
      } else if (i < held_sorted.size() && held_sorted[i].first == want[j]) {
        is_wanted[held_sorted[i].second] = 1;
        s[held_sorted[i].second] = step;
        ++i;
        ++j;
      } else {
        missing.push_back(want[j]);
        ++j;
      }
    }
    // and with the used ones (the previous step attended them: evicted last)
    i = j = 0;
    while (i < held_sorted.size() && j < used_sorted.size()) {
      if (held_sorted[i].first < used_sorted[j]) {
        ++i;
      } else if (used_sorted[j] < held_sorted[i].first) {
        ++j;
      } else {
        s[held_sorted[i].second] = step;
        ++i;
      }
    }
    const int64_t need = static_cast<int64_t>(missing.size());
    victims.clear();  // free slots by (empty first, then the last step used, then slot): the order of a stable sort
    for (int64_t c = 0; c < capacity; ++c)
      if (!is_wanted[c]) victims.push_back((h[c] < 0 ? 0 : s[c] + 1) * capacity + c);
    if (need > static_cast<int64_t>(victims.size())) return -1 - g;
    total_wanted += static_cast<int64_t>(want.size());
    total_resident += static_cast<int64_t>(want.size()) - need;
    std::partial_sort(victims.begin(), victims.begin() + need, victims.end());
    std::fill(written.begin(), written.end(), 0);
    for (int64_t m = 0; m < need; ++m) {
      const int64_t c = victims[m] % capacity;
      h[c] = missing[m];
      s[c] = step;
      written[c] = 1;
      out_group[count] = g;
      out_slot[count] = c;
      out_position[count] = missing[m];
      ++count;
    }
    if (exclusive) {
      for (int64_t c = 0; c < capacity; ++c) {
        if (h[c] >= 0 && !is_wanted[c] && !written[c]) {
          h[c] = -1;
          out_group[count] = g;
          out_slot[count] = c;
          out_position[count] = -1;
          ++count;
        }
      }
    }
  }
  totals[0] = total_wanted;
  totals[1] = total_resident;
  return count;
}

}  // extern "C"
