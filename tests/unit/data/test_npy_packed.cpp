// NeMo's packed SFT .npy files (the MLPerf Llama-2 70B LoRA data layout), written by numpy itself
// (/usr/bin/python3, Debian's python3-numpy): the restricted reader accepts the object arrays np.save
// writes (pickle protocols 2-5, lists and numpy arrays, bools, numpy scalars) and refuses a pickle that
// would run code without running it; NpyPackedDataset gives exactly the tokens, labels and loss mask of
// NeMo's GPTSFTPackedDataset.collate_fn (computed by Python from that definition) and NeMo's record order
// (numpy.random.seed + one shuffle per epoch).
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "data/npy_pickle.h"
#include "loom/core/check.h"
#include "loom/data/npy_packed_dataset.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

class NpyFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (fs::temp_directory_path() / ("loom_npy_" + std::to_string(::getpid()))).string();
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  // Runs a Python snippet in dir_ (numpy imported as np); fails the test if it does not exit 0.
  std::string python(const std::string& code) {
    const std::string script = dir_ + "/gen.py", out = dir_ + "/gen.out";
    std::ofstream(script) << "import numpy as np, os, pickle, sys\nos.chdir(" << '"' << dir_ << '"' << ")\n" << code;
    const int rc = std::system(("/usr/bin/python3 " + script + " > " + out + " 2>&1").c_str());
    std::stringstream ss;
    ss << std::ifstream(out).rdbuf();
    EXPECT_EQ(rc, 0) << ss.str();
    return ss.str();
  }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  std::string dir_;
};

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const UserError& e) {
    return e.what();
  }
  return "no error";
}

const char* kRecords = R"(
recs = [
  {'input_ids': [5, 6, 7, 8, 9, 10, 11], 'loss_mask': [0, 0, 1, 1, 0, 1, 1], 'seq_start_id': [0, 4]},
  {'input_ids': np.array([20, 21, 22, 23, 24], dtype=np.int64), 'loss_mask': [False, False, True, True, True],
   'seq_start_id': [0]},
  {'input_ids': [30, 31, 32, 33, 34, 35, 36, 37, 38], 'loss_mask': np.array([0, 1, 1, 0, 1, 1, 0, 1, 1], dtype=np.int8),
   'seq_start_id': [np.int64(0), 3, 6]},
]
)";

TEST_F(NpyFiles, ReaderAcceptsNumpyObjectArraysInEveryProtocol) {
  python(std::string(kRecords) + R"(
np.save('p3.npy', np.array(recs, dtype=object))
arr = np.array(recs, dtype=object)
for proto in (2, 4, 5):  # np.save always writes protocol 3: the header, then the pickle by hand
    with open('p%d.npy' % proto, 'wb') as f:
        np.lib.format.write_array_header_1_0(f, np.lib.format.header_data_from_array_1_0(arr))
        pickle.dump(arr, f, protocol=proto)
np.save('ints.npy', np.arange(6, dtype=np.int32))
)");
  for (const char* f : {"p2.npy", "p3.npy", "p4.npy", "p5.npy"}) {
    SCOPED_TRACE(f);
    const npy::Array a = npy::load_npy(path(f));
    ASSERT_EQ(a.dtype, "O");
    ASSERT_EQ(a.objects.size(), 3u);
    const auto& r2 = a.objects[2]->dict;
    EXPECT_EQ(npy::int_list(*r2.at("input_ids"), "x"), (std::vector<int64_t>{30, 31, 32, 33, 34, 35, 36, 37, 38}));
    EXPECT_EQ(npy::int_list(*r2.at("loss_mask"), "x"), (std::vector<int64_t>{0, 1, 1, 0, 1, 1, 0, 1, 1}));
    EXPECT_EQ(npy::int_list(*r2.at("seq_start_id"), "x"), (std::vector<int64_t>{0, 3, 6}));
    EXPECT_EQ(npy::int_list(*a.objects[1]->dict.at("loss_mask"), "x"), (std::vector<int64_t>{0, 0, 1, 1, 1}));
  }
  const npy::Array ints = npy::load_npy(path("ints.npy"));
  EXPECT_EQ(ints.dtype, "i4");
  EXPECT_EQ(ints.numel(), 6);
}

TEST_F(NpyFiles, APickleThatWouldRunCodeIsRefusedWithoutRunningIt) {
  python(R"(
class Evil:
    def __reduce__(self):
        return (os.system, ('touch pwned',))
arr = np.empty(1, dtype=object)
arr[0] = Evil()
np.save('evil.npy', arr, allow_pickle=True)
arr[0] = {'input_ids': [1, 2], 'loss_mask': [0, 1], 'seq_start_id': [0], 'x': 1.5}
np.save('float.npy', arr)
arr[0] = {'input_ids': [1, 2], 'loss_mask': [0, 1], 'seq_start_id': [0]}
np.save('ok.npy', arr)
loop = [1]
loop.append(loop)
arr[0] = {'input_ids': loop, 'loss_mask': [0, 1], 'seq_start_id': [0]}
np.save('cycle.npy', arr)
arr[0] = {'input_ids': [1, 2], 'loss_mask': [0, 1], 'seq_start_id': [0]}
data = open('ok.npy', 'rb').read()
open('truncated.npy', 'wb').write(data[:-20])
)");
  const std::string evil = error_of([&] { npy::load_npy(path("evil.npy")); });
  EXPECT_NE(evil.find("is not allowed"), std::string::npos) << evil;
  EXPECT_NE(evil.find("evil.npy"), std::string::npos) << evil;
  EXPECT_FALSE(fs::exists(path("pwned")));
  EXPECT_NE(error_of([&] { npy::load_npy(path("float.npy")); }).find("is not allowed"), std::string::npos);
  EXPECT_NE(error_of([&] { npy::load_npy(path("truncated.npy")); }).find("ends early"), std::string::npos);
  EXPECT_NE(error_of([&] { npy::load_npy(path("cycle.npy")); }).find("a value that contains itself"), std::string::npos);
  std::ofstream(path("text.npy")) << "not numpy";
  EXPECT_NE(error_of([&] { npy::load_npy(path("text.npy")); }).find("not a .npy file"), std::string::npos);
}

TEST_F(NpyFiles, PackedDatasetEqualsNeMoCollateAndOrder) {
  // NeMo's collate_fn per record: inputs/labels/mask/positions per sample, concatenated; and its samples
  // mapping for 7 samples of 3 records with seed 1234.
  const std::string out = python(std::string(kRecords) + R"(
np.save('train.npy', np.array(recs, dtype=object))
for r in recs:
    ids = [int(x) for x in r['input_ids']]; m = [int(x) for x in r['loss_mask']]
    b = [int(x) for x in r['seq_start_id']] + [len(ids)]
    toks, labs, mask = [], [], []
    for i in range(len(b) - 1):
        toks += ids[b[i]:b[i+1]-1]; labs += ids[b[i]+1:b[i+1]]; mask += m[b[i]+1:b[i+1]]
    print(' '.join('%d:%d' % (l, k) for l, k in zip(labs, mask)))
np.random.seed(1234)
idx = np.arange(3)[None, :].repeat(3, axis=0)
[np.random.shuffle(x) for x in idx]
print(' '.join(str(x) for x in idx.reshape(1, -1).squeeze()[:7]))
)");
  std::vector<std::string> lines;
  std::stringstream ss(out);
  for (std::string l; std::getline(ss, l);) lines.push_back(l);
  ASSERT_EQ(lines.size(), 4u) << out;
  const NpyPackedDataset ds(path("train.npy"), 12, 7, 1234, 99);
  ASSERT_EQ(ds.size(), 7);
  ASSERT_EQ(ds.records(), 3);
  // The order: sample i is record order[i]; records start with 5, 20, 30.
  std::vector<int64_t> order;
  std::stringstream os(lines[3]);
  for (int64_t x; os >> x;) order.push_back(x);
  std::vector<int32_t> w(13);
  std::vector<float> mask(12);
  std::vector<int32_t> pos(12), seg(12);
  for (int64_t i = 0; i < 7; ++i) {
    ds.sample(i, w.data());
    EXPECT_EQ(w[0], (std::vector<int32_t>{5, 20, 30})[size_t(order[size_t(i)])]) << "sample " << i;
    // Errors name the record and the input_ids entry (or the padding) a token came from.
    const std::string r = std::to_string(order[size_t(i)]);
    EXPECT_EQ(ds.locate(i, 3), path("train.npy") + ": record " + r + ", input_ids[3]");
    EXPECT_EQ(ds.locate(i, 12), path("train.npy") + ": padding after record " + r + " (the pad id 99)");
  }
  // Every label NeMo puts in the loss is in Loom's (same label, and only those).
  for (int64_t i = 0; i < 7; ++i) {
    ds.sample(i, w.data());
    ASSERT_TRUE(ds.extras(i, mask.data(), pos.data(), seg.data()));
    const int64_t r = order[size_t(i)];
    std::vector<std::pair<int, int>> nemo;
    std::stringstream ls(lines[size_t(r)]);
    for (std::string t; ls >> t;) nemo.emplace_back(std::stoi(t.substr(0, t.find(':'))), std::stoi(t.substr(t.find(':') + 1)));
    std::vector<int> nemo_in_loss, loom_in_loss;
    for (const auto& [label, m] : nemo)
      if (m) nemo_in_loss.push_back(label);
    for (int j = 0; j < 12; ++j)
      if (mask[size_t(j)] != 0.0f) loom_in_loss.push_back(w[size_t(j) + 1]);
    EXPECT_EQ(loom_in_loss, nemo_in_loss) << "record " << r;
  }
  // Record 2 (samples at 0, 3, 6): positions restart, segments per sample, then padding.
  for (int64_t i = 0; i < 7; ++i)
    if (order[size_t(i)] == 2) {
      ds.extras(i, mask.data(), pos.data(), seg.data());
      EXPECT_EQ(pos, (std::vector<int32_t>{0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2}));
      EXPECT_EQ(seg, (std::vector<int32_t>{0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3}));
      ds.sample(i, w.data());
      EXPECT_EQ(w[9], 99);  // padding
      break;
    }
  EXPECT_NE(error_of([&] { NpyPackedDataset(path("train.npy"), 7, 1, 1, 0); }).find("do not fit --seq-length + 1 = 8"),
            std::string::npos);
}

}  // namespace
}  // namespace loom
