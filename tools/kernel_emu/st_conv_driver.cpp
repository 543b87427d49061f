// step.hip's st_conv over random conv state in two ranks' regions; writes the
// outputs and both regions to the file named last, for ab.sh to compare
// against another revision. Arguments: conv width, storage dtype (0 f32,
// 1 bf16, 2 f16), requests.
#include <random>
int main(int argc, char** argv) {
    if (argc != 5) return 2;
    const int width = atoi(argv[1]), dt = atoi(argv[2]), B = atoi(argv[3]);
    const int H = 4, tp = 2, hl = H / tp, dk = 8, dv = 16, C = H * (2 * dk + dv), cr = hl * (2 * dk + dv);
    const int hist = width - 1, eb = dt == 0 ? 4 : 2, units = 2 * B + 1;
    const hk_i64 unit_stride = (hk_i64)(hist > 0 ? hist : 1) * cr * eb + 64;
    std::mt19937 rng(3 + width + dt + B);
    std::uniform_real_distribution<float> U(-1, 1);
    std::vector<float> proj((size_t)B * (C + 5)), weight((size_t)C * width), out((size_t)B * C, 0.0f);
    for (auto& x : proj) x = U(rng);
    for (auto& x : weight) x = U(rng);
    std::vector<std::vector<unsigned char>> region(tp, std::vector<unsigned char>((size_t)units * unit_stride));
    for (auto& r : region)
        for (size_t i = 0; i + eb <= r.size(); i += eb) st_st(r.data() + i, dt, U(rng));
    // tick[0]: live requests; tick[1 + b * tp + r]: request b's unit in rank r (reversed, apart).
    std::vector<int> tick(1 + B * tp);
    tick[0] = B;
    for (int b = 0; b < B; ++b)
        for (int r = 0; r < tp; ++r) tick[1 + b * tp + r] = 2 * (B - 1 - b) + r % 2;
    std::vector<unsigned long long> rows(tp);
    for (int r = 0; r < tp; ++r) rows[r] = (unsigned long long)region[r].data();
    launch({(unsigned)((C + 255) / 256), (unsigned)B, 1}, 256, [&] {
        st_conv(proj.data(), C + 5, weight.data(), tick.data(), 1, tp, rows.data(), unit_stride, dt, out.data(), B, H, hl, dk, dv, width);
    });
    FILE* f = fopen(argv[4], "wb");
    fwrite(out.data(), 4, out.size(), f);
    for (auto& r : region) fwrite(r.data(), 1, r.size(), f);
    fclose(f);
    return 0;
}
